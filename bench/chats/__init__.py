"""Chats and engines: time to first token per turn, setup against setup, on real vLLM engines
(one engine, vLLM's NixlConnector P/D, our P/D with the broker). Programs: compare, multiturn_ttft,
pd_compare, pull_policy; child program: nixl_proxy. docs/bench.md."""
