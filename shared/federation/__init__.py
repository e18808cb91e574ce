"""Protocol features of the federation that every method may use, above the wire and
below the methods: how a device picks its edge each round (FedPhD's eq. 25, with
``federation.assignment = "select"``; :mod:`shared.federation.selection`). Numpy only, so a
device role imports it without the methods' packages.
"""
