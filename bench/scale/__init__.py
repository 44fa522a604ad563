"""Scale: one in-memory broker against replicas over one Redis and over a Redis Cluster.
Program: replicas; child program: mirror. docs/scale.md."""
