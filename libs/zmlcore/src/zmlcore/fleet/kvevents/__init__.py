"""KV-cache events of serving engines: vLLM's ZMQ wire format (``wire``) and the subscriber's
sequence/replay state machine (``sequence``). Pure: no sockets here; the bridge that owns the
sockets lives in the health service, the publisher in the simulated node."""
