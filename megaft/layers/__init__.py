"""Tensor-parallel building blocks; each takes the tp `group`, not the grid."""
from megaft.config.model import padded_size
from megaft.kernels.cross_entropy.reference import vocab_parallel_cross_entropy
from megaft.layers.embedding import VocabParallelEmbedding
from megaft.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaft.layers.norm import RMSNorm
from megaft.parallel.tensor.shard import TPShard, shard_of

__all__ = [
    "ColumnParallelLinear", "RMSNorm", "RowParallelLinear", "TPShard", "VocabParallelEmbedding",
    "padded_size", "shard_of", "vocab_parallel_cross_entropy",
]
