"""Tensor parallelism across processes: one engine process per rank, joined by torch.distributed.

`group` joins a rank to the process group, `launch` starts and watches ranks 1..N-1 from rank 0,
`step` carries each step's batch from rank 0 to the others, `follower` is the main of a rank
other than 0, `checks` refuses a world size that cannot work. The sharding itself is
`freetoken.models.shard`; rank 0 alone owns the scheduler and the KV page accounting.
"""
