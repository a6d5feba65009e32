"""Detection: log lines -> classified fault events (the catalog, the detector, the parse stage on Kafka)."""
