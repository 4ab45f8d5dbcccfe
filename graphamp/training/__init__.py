"""Training: Paddle-style dynamic loss scaling (LossScaler) and decorate(), the optimizer wrapper."""
