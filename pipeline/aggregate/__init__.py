"""Aggregation: fault events -> per-node incidents and fabric signals (state model, rules, batching)."""
