"""xidflow: NVIDIA GPU fault detection and Kubernetes remediation on Kafka."""
