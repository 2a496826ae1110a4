"""Supervising one launch: start the rank processes, watch them all at once, stop them all.

The parent waits on every rank's message pipe, output pipes and exit sentinel in one loop, so it
hears at once of a result, an exception, a silent death (os._exit, a signal, a C++ abort) or an
interrupt, whatever the other ranks are doing. What went wrong is put into words by `_explain`.

The package, one module per idea:
- `starting`: the start method (a forkserver with torch preloaded), starting a process without
  re-importing the parent's __main__, the rendezvous port and store;
- `one_launch`: one run of a function on its ranks (`Launch`): start, watch, report, stop.
"""
from .one_launch import Launch, Results, _Rank  # noqa: F401
from .starting import (_get_context, _start_without_main, cores, free_port,  # noqa: F401
                       loopback_listener, parent_store)
