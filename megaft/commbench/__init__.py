"""`megaft-commbench`: collective and point-to-point bandwidth of the allocation a run gets.

config (CommbenchConfig, config layer) -> busbw (nccl-tests' definitions) -> groups (scopes
from the grid and the hosts) -> ep (the expert-parallel all-to-all's sizes, splits and cost
model price) -> measure (timed, checked collectives) -> pairs (node-pair matrix, slow
links) -> results (the commbench.json document) -> verdict (check mode) ->
report (files, table) -> run (a rank's body) -> app (the Hydra entry point).
"""
