"""The backends a program runs on: the `Backend` Protocol (backend.py), the in-kernel engine
(`sgl.Runtime`, local_runtime.py) and a server (`sgl.RuntimeEndpoint`, runtime_endpoint.py,
with its HTTP clients in remote/)."""
