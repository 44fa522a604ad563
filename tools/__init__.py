"""The top layer: programs built on the broker, the clients and the engine adapter.

- `cli`: the `kvbroker` command (serve the broker, inspect and drive it).
- `demo`: `make run`, the broker with P and D vLLM engines and the proxy.
- `launch`: start a vLLM OpenAI server process with our connector.
- `tiny_model`: build a small random-weight Llama model locally, for tests and demos.

vLLM never imports these; nothing below this layer imports them.
"""
