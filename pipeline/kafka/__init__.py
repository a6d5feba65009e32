"""Kafka plumbing: the one client factory, admin, ACLs, lag, group membership, the seam to upstream internals."""
