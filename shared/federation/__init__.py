"""Protocol features of the federation that every method may use, above the wire and
below the methods: how a device picks its edge each round (FedPhD's eq. 25, with
``federation.assignment = "select"``; :mod:`shared.federation.selection`), and which broker
each role talks through with a broker per edge site and what the bridges carry
(``federation.brokers``; :mod:`shared.federation.topology`). Neither needs torch: a device role
imports them without the methods' packages.
"""
