"""Tensor parallelism over torch.distributed: the group, the sharding plan, the batch broadcast."""
