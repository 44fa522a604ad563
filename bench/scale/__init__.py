"""Scale: one in-memory broker against replicas over one Redis and over a Redis Cluster.
Programs: replicas, lease_cpu (lease-cycle CPU, two replicas against in-memory); child program:
mirror. docs/scale.md."""
