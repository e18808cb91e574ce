"""Process plumbing every role shares: the message-driven :class:`RoleService` base (decode,
validate, reject with a reason, count), the role process runner (arguments, logging,
signals, the MQTT connection, a clean goodbye) and CPU/thread limits. Nothing here knows an
algorithm or a model.
"""
