"""The MLX engine: model loading, continuous batching, the engine thread. Knows nothing of ZeroMQ."""
