"""Fleet: the serving stack as a whole: leases reclaimed after a reader is killed, what an idle
holder costs, many chats at once through the demo stack, the dashboard drawn from a real run.
Programs: reclaim, idle_hold, chat_load, dashboard; child program: reader_session. docs/bench.md."""
