"""Pipeline parallelism: schedules as data, their validator, a simulator and a timeline plot.

Pipeline parallelism lives here, not under megaft/parallel/ (which holds tensor, context
and data parallelism): one home, this package, with its stage model (`stage`) and the
p2p runtime (`runtime`).

A schedule is `{rank: [Action, ...]}` built by a pure function (`gpipe`,
`one_f_one_b`, `interleaved_1f1b`, or `build_schedule(name, ...)`) or loaded from a
CSV; `validate` checks it without processes and `simulate` replays it with costs.
`plot_timeline` (matplotlib) lives in `megaft.pipeline.plot` so importing this
package never needs matplotlib.
"""
from megaft.pipeline.actions import (
                                     Action,
                                     ActionKind,
                                     ScheduleError,
                                     chunk_of,
                                     format_table,
                                     message_of,
                                     parse_action,
                                     rank_of,
)
from megaft.pipeline.comm_plan import nccl_problems
from megaft.pipeline.schedules import (
                                     SCHEDULES,
                                     Schedule,
                                     add_send_recv,
                                     build_schedule,
                                     dump_schedule,
                                     gpipe,
                                     interleaved_1f1b,
                                     load_schedule,
                                     one_f_one_b,
)
from megaft.pipeline.simulate import Cost, Interval, SimResult, peak_in_flight, simulate
from megaft.pipeline.validate import validate

__all__ = [
    "Action", "ActionKind", "ScheduleError", "chunk_of", "format_table", "message_of",
    "parse_action", "rank_of", "SCHEDULES", "Schedule", "add_send_recv", "build_schedule",
    "dump_schedule", "gpipe", "interleaved_1f1b", "load_schedule", "one_f_one_b", "Cost",
    "Interval", "SimResult", "peak_in_flight", "simulate", "validate", "nccl_problems",
]
