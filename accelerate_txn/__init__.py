"""accelerate-txn: transactional, verified training checkpoints for Hugging Face Accelerate."""
