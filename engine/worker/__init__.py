"""What runs a model on a device: the model runner and its input batch, the sampler, KV cache
sizing and allocation, CUDA graphs, tensor-parallel ranks."""
