"""Start ``flashrt serve --tp N --ep M``: the ranks, rank 0's HTTP server, the others following it.

The parent checks the request and the checkpoint, then starts the ranks
(:func:`flashrt.engine.launch.launch`; under ``torchrun`` this process is one of them). Every rank
loads its slices and builds the same engine; rank 0 serves HTTP and leads, the others follow
(:mod:`flashrt.engine.parallel_serve`). SIGTERM to the parent goes to rank 0, which drains like a
one-device server and then stops every rank. A failed rank ends the server: the parent raises the
launcher's :class:`~flashrt.engine.launch.RankError` naming it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal

import torch

from flashrt.progress import Progress

from flashrt.graphs.config import ModelConfig
from flashrt.graphs.loader import load
from flashrt.graphs.parallel import Layout, Parallel
from .config import EngineConfig
from .engine import Engine
from .launch import launch, under_torchrun
from .parallel_groups import GroupedEngine
from .parallel_run import checkpoint_path
from .parallel_serve import Lockstep, follow, leave_signals_to_rank_0
from .run import pick_device
from .speculative import check_config


@dataclasses.dataclass
class ServeJob:
    model: str
    tp: int
    ep: int
    config: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    name: str | None = None
    api_key: str | None = None
    device: str | None = None
    seed: int = 0
    threads: int | None = None
    grace_s: float = 30.0
    log_level: str = "info"
    timeout_s: float = 600.0  # the collective timeout
    dp_attention: bool = False  # each group runs only its own requests (engine/parallel_groups.py)


def check(job: ServeJob) -> Layout:
    """Refuse what the ranks cannot run, before any of them starts."""
    layout = Layout(job.tp, job.ep)
    if job.config.prefix_cache_dir:
        raise ValueError(f"prefix_cache_dir: a disk prefix cache is not shared by the ranks of --tp / --ep "
                         f"(the in-memory one works), got {job.config.prefix_cache_dir!r}")
    if not isinstance(job.dp_attention, bool):
        raise ValueError(f"dp_attention: expected a bool, got {job.dp_attention!r}")
    if job.dp_attention and job.ep < 2:
        raise ValueError(f"dp_attention: spreads the requests over the expert-parallel groups, expected --ep >= 2, "
                         f"got --ep {job.ep}")
    if job.dp_attention and job.config.cuda_graphs:
        raise ValueError("cuda_graph: decode steps with --dp-attention run eagerly (every forward exchanges the "
                         "groups' token counts first); drop --cuda-graph or --dp-attention")
    if job.dp_attention and job.config.speculative is not None:
        raise ValueError(f"speculative: with --dp-attention the groups run different requests, so their verify "
                         f"rounds cannot line up; drop --speculative {job.config.speculative} or --dp-attention")
    if isinstance(job.timeout_s, bool) or not job.timeout_s > 0:
        raise ValueError(f"collective_timeout: expected seconds > 0, got {job.timeout_s!r}")
    kind = pick_device(job.device).type
    if job.config.cuda_graphs and kind != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the device is {kind}")
    if job.config.speculative is not None and kind == "cuda" and job.config.cuda_graphs is not False:
        raise ValueError("cuda_graph: speculative rounds across ranks have not run from CUDA graphs on GPUs "
                         "(the replicated draft gathers its logits inside the step); pass --no-cuda-graph with "
                         "--speculative and --tp / --ep")
    if kind == "cuda" and not under_torchrun() and torch.cuda.device_count() < layout.world:
        raise ValueError(f"tp: tp * ep = {layout.world} ranks need {layout.world} cuda devices, "
                         f"found {torch.cuda.device_count()}")
    return layout


def serve_parallel(job: ServeJob, on_event=None) -> int:
    """Run the server on ``tp * ep`` ranks until it stops; rank 0's exit status. ``on_event(event,
    pids)``: as for :func:`~flashrt.engine.launch.launch` (the ranks' process ids, by rank)."""
    layout = check(job)
    kind = pick_device(job.device).type
    path = checkpoint_path(job.model, job.seed, job.log_level not in ("info", "debug"))
    cfg = ModelConfig.from_file(str(path / "config.json"))
    layout.check(cfg)
    check_config(cfg, cfg.n_mtp_layers > 0, job.config.speculative, job.config.draft_tokens)
    job = dataclasses.replace(job, model=str(path), config=job.config,
                              name=job.name or os.path.basename(os.path.normpath(job.model)),
                              threads=job.threads or max(1, (os.cpu_count() or 1) // layout.world))
    pids: list[int] = []

    def events(event, ranks):
        pids[:] = ranks
        if on_event is not None:
            on_event(event, ranks)

    def on_term(sig, frame):  # rank 0 drains and stops the others; before it runs, stop everything
        if pids:
            os.kill(pids[0], signal.SIGTERM)
        else:
            raise SystemExit(1)
    previous = {}
    if not under_torchrun():  # Ctrl-C reaches rank 0 itself (one process group): the parent waits for it
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
                    signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    try:
        results = launch(serve_rank, layout.world, (job,), device=kind, timeout_s=job.timeout_s, on_event=events)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return next((r["exit"] for r in results if r["rank"] == 0), 0)


def serve_rank(rank: int, device, job: ServeJob, report=None) -> dict:
    """One rank: load its slices, build the engine; rank 0 serves and leads, the others follow."""
    if rank != 0:
        leave_signals_to_rank_0()
    if report is not None:
        report("serve", 0)  # the parent learns the ranks' process ids
    if device.type == "cpu":
        torch.set_num_threads(job.threads)
    logging.basicConfig(level=job.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    par = Parallel(Layout(job.tp, job.ep, rank), "gather" if job.dp_attention else "replicated")
    show = rank == 0 and job.log_level in ("info", "debug")
    model = load(job.model, device=device, parallel=par, progress=Progress(f"loading rank {rank}", enabled=show))
    engine = group_engine(model, job.config, job.ep) if job.dp_attention else Engine(model, config=job.config)
    if rank != 0:
        return {"rank": rank, "steps": follow(engine)}
    return {"rank": 0, "exit": _serve(engine, job)}


def group_engine(model, config: EngineConfig, ep: int) -> GroupedEngine:
    """This rank's engine with data-parallel attention: ``max_running`` (the whole server's) is
    divided over the ``ep`` groups, so each rank's pool is sized for its group's sequences."""
    config = dataclasses.replace(config, max_running=-(-config.max_running // ep), cuda_graphs=False)
    return GroupedEngine(model, config=config)


def _serve(engine, job: ServeJob) -> int:
    """Rank 0: the HTTP server over the leading engine; raises the collective failure that ended it."""
    import uvicorn

    from .server.app import create_app

    app = create_app(engine, job.name, api_key=job.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.accepting = False  # stop admitting at once; uvicorn then drains the connections
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()  # a drained shutdown is a normal exit

    server = Server(uvicorn.Config(app, host=job.host, port=job.port, log_level=job.log_level,
                                   timeout_graceful_shutdown=job.grace_s, access_log=job.log_level == "debug"))
    lockstep = Lockstep(engine, tick_s=min(1.0, job.timeout_s / 4),
                        on_failure=lambda exc: setattr(server, "should_exit", True))
    engine.lockstep = lockstep
    layout = engine.model.parallel.layout
    logging.getLogger("flashrt").info("serving %s on http://%s:%d over %d ranks (tp %d x ep %d%s)", job.name, job.host,
                                      job.port, layout.world, layout.tp, layout.ep,
                                      ", data-parallel attention" if job.dp_attention else "")
    try:
        server.run()
    finally:
        engine.shutdown(grace_s=0)
        lockstep.close()
    if lockstep.failed is not None:
        raise lockstep.failed
    return 0 if server.started else 1
