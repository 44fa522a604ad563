"""Watch event kinds that broker and clients both act on (the rest are for display)."""

# A Watch lost events: of a broker fleet (the shared store was away too long, or restarted
# empty), or across a move to another replica that could not give them all back.
EVENTS_MISSED = "events_missed"
# Sent on a Watch that asked for it (heartbeat_ms) when it had nothing else to send: the replica
# lives. Carries the cursor a resumed Watch names (resume_after).
HEARTBEAT = "heartbeat"
