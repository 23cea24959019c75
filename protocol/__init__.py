"""The contract between edge devices and the cloud aggregator (protocol v1).

Topic names (:mod:`.topics`), versioned message schemas (:mod:`.messages`), the
tensor codec (:mod:`.codec`), blob chunking (:mod:`.chunking`), adapter-state key
names (:mod:`.keys`), expert assignments and their JSON form (:mod:`.experts`) and the
MQTT transport (:mod:`.transport`).
"""
