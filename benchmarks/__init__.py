"""Benchmarks against peers (torch DDP / FSDP2 / fused optimizers, DeepSpeed when installed)."""
