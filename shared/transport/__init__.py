"""Moving messages and blobs: the :class:`~shared.transport.bus.Bus` interface with its
in-memory twin (``MemoryBus``) and the MQTT implementation (``MqttBus``, paho-mqtt 2.x),
chunked content-addressed blob serving and fetching, the on-disk blob cache, per-kind
traffic counters, and a local broker for demos and tests (Mosquitto, or embedded amqtt).
Torch-free, and the only place that imports paho.
"""
