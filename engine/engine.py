"""``flashrt.engine.Engine``: the serving engine's public face.

Offline: ``Engine(model).generate(prompts, SamplingParams(...))`` runs a batch job to the end in the
calling thread. Online (the server): :meth:`Engine.start` runs the step loop in a background thread;
``add_request`` / ``stream`` / ``abort`` are safe to call from an asyncio event loop (requests and
aborts are queued for the loop thread, outputs come back through the caller's event loop).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from . import loop_profile, outputs, step_trace
from .config import EngineConfig
from .errors import QueueFull, RequestError
from .front import BatchSink, EngineFront, deliver_grouped, is_token_list
from .images import batch_images
from .request import Request, RequestOutput, Status, finished_record
from .sampling import SamplingParams
from .step_loop import StepLoop
from .text import eos_id, tokenizer_for

log = logging.getLogger("flashrt.engine")


class Engine(EngineFront):
    """Continuous-batching engine over one model. Keyword arguments are :class:`EngineConfig` fields."""

    step_loop_class = StepLoop  # a subclass may run a variant (engine/parallel_groups.py)

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError(f"config: pass an EngineConfig or keyword settings, not both (got {sorted(kwargs)})")
        self.model = model
        self.tokenizer = tokenizer_for(model, tokenizer)
        config = dataclasses.replace(config) if config is not None else EngineConfig(**kwargs)  # ours to resolve
        if config.eos_token_id is None:
            config.eos_token_id = eos_id(self.tokenizer)
        self.tokenizer.stream()  # builds the tokenizer's per-id byte table now, not in the first request's step
        self.step_loop = self.step_loop_class(model, config, self.tokenizer)
        self.config = self.step_loop.config
        self.limits = self.step_loop.limits
        self._init_front()
        self._cv = threading.Condition()
        self._commands: list = []  # ("add", Request-args) / ("abort", id), applied by the loop thread
        self._thread: threading.Thread | None = None
        self._profile: str | None = None  # FLASHRT_PROFILE_ENGINE (engine/loop_profile.py)
        self._trace: str | None = None  # FLASHRT_STEP_TRACE (engine/step_trace.py)
        self._stop = False
        self.accepting = True
        self.step_error: str | None = None
        self.lockstep = None  # several ranks: sends each turn's commands to the others first (parallel_serve.py)

    # ----- offline ---------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 images=None) -> list[RequestOutput]:
        """Run ``prompts`` (a string, a token-id list, or a list of them) to the end; one final
        :class:`RequestOutput` per prompt, in order. ``images``: None or one entry per prompt (a
        list of its images, one per image placeholder, as ``add_request`` takes them, or None); for a
        single prompt, its list of images."""
        single = isinstance(prompts, str) or is_token_list(prompts)
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise RequestError("prompts", "expected at least one prompt, got none")
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError("params", f"expected {len(prompts)} SamplingParams (one per prompt), got {len(plist)}")
        ids = [self.encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if single and images is not None:
            images = [images]  # one prompt: ``images`` is its list of images
        ids, pics = zip(*batch_images(self.model, self.tokenizer, ids, images, plist, self.config.max_model_len))
        for i, (p, sp) in enumerate(zip(ids, plist)):
            self.step_loop.check(p, sp)
        if self._thread is not None:
            return self._generate_online(ids, plist, pics)
        done: dict[str, RequestOutput] = {}
        names = []
        for p, sp, pic in zip(ids, plist, pics):
            req = self.step_loop.add(self._new_id(None), p, sp, pic)
            req.sink = lambda out, done=done: done.__setitem__(out.request_id, out) if out.finished else None
            names.append(req.id)
        while self.step_loop.has_work:
            self._deliver(self.step_loop.step())
        return [done[n] for n in names]

    def _generate_online(self, ids, plist, pics) -> list[RequestOutput]:
        events, done = [], {}
        for p, sp, pic in zip(ids, plist, pics):
            ev = threading.Event()
            rid = self._new_id(None)

            def sink(out, ev=ev):
                if out.finished:
                    done[out.request_id] = out
                    ev.set()
            self._submit(rid, p, sp, sink, pic)
            events.append((rid, ev))
        for rid, ev in events:
            ev.wait()
        return [done[rid] for rid, _ in events]

    def warm_up(self, progress=None) -> dict:
        """Run every decode batch size up to ``max_running`` and every prefill shape class once with
        synthetic requests, so that serving meets no new kernel variant or decode graph of a batch
        size (engine/warmup.py). Call before :meth:`start`; ``progress(done, total, what, prompts)``
        after each round."""
        if self._thread is not None:
            raise RuntimeError("warm_up: expected an engine not started yet (call it before start())")
        from .warmup import warm_up

        return warm_up(self, progress)

    # ----- online ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the step loop in a background thread (idempotent)."""
        if self._thread is None:
            self._profile = loop_profile.profile_path()
            self._trace = step_trace.trace_path()
            self._thread = threading.Thread(target=self._loop, name="flashrt-engine", daemon=True)
            self._thread.start()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (a no-op for an unknown or finished one)."""
        with self._cv:
            self._commands.append(("abort", request_id))
            self._cv.notify()

    def _submit(self, rid, ids, params, sink, images=None) -> None:
        with self._cv:  # a request's images travel as their own command, just before its add
            if images is not None:
                self._commands.append(("images", (rid, images)))
            self._commands.append(("add", (rid, ids, params, sink)))
            self._cv.notify()

    def _waiting(self) -> int:
        with self._cv:
            pending = sum(1 for c in self._commands if c[0] == "add")
        return self.step_loop.num_waiting + pending

    # ----- the loop thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        trace = step_trace.StepTrace(self._trace) if self._trace else None
        self.step_loop.trace = trace
        try:
            with loop_profile.profiled(self._profile):
                self._run_loop()
        finally:
            self.step_loop.trace = None
            if trace is not None:
                trace.close()

    def _run_loop(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self.step_loop.has_work and not self._stop:
                    if self.step_loop.trace is not None:  # idle: the steps so far reach the file
                        self.step_loop.trace.flush()
                    self._cv.wait()
                if self._stop and not self._commands:
                    return
                commands, self._commands = self._commands, []
            if self.lockstep is not None:
                commands = self.lockstep.share(commands)
            self._apply(commands)
            if self.step_loop.has_work:
                try:
                    self._deliver(self.step_loop.step())
                except Exception as exc:  # noqa: BLE001 - a bug in a step must not hang every client
                    log.exception("engine step failed")
                    self.step_error = f"{type(exc).__name__}: {exc}"
                    self._fail_all(exc)

    def _apply(self, commands) -> None:
        images = {}
        for kind, arg in commands:
            if kind == "images":
                images[arg[0]] = arg[1]
            elif kind == "add":
                rid, ids, params, sink = arg
                try:
                    req = self.step_loop.add(rid, ids, params, images.pop(rid, None))
                except (ValueError, QueueFull) as exc:  # raced with another add: report it as an output
                    sink(RequestOutput(rid, ids, [], True, f"{type(exc).__name__}: {exc}"))
                    continue
                req.sink = sink
            else:
                req = self.step_loop.abort(arg)
                if req is not None:
                    self._deliver([req])

    def _deliver(self, requests: list[Request]) -> None:
        """Each request's new output to its sink; outputs whose sinks share a ``batch_key`` (one
        event loop, one pipe) go in one hand-off per step (:meth:`AsyncSink.deliver_batch`)."""
        grouped = []
        for req in requests:
            if isinstance(req.sink, BatchSink):
                grouped.append((req.sink, outputs.request_output(req)))
            elif req.sink is not None:
                req.sink(outputs.request_output(req))
        deliver_grouped(grouped, self.abort)

    def _fail_all(self, exc: Exception) -> None:
        touched: set = set()
        for req in list(self.step_loop.requests.values()):
            self.step_loop._fail(req, exc, touched)
        self._deliver(list(touched))

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting; let running requests finish for up to ``grace_s`` seconds, abort the
        rest, stop the loop thread."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._thread is not None and self.step_loop.has_work and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self.step_loop.requests):
            self.abort(rid)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=max(grace_s, 5.0))
            self._thread = None

    def on_finish(self, hook) -> None:
        """Call ``hook`` with a :class:`~flashrt.engine.request.Finished` record of each finished request."""
        self.step_loop.finish_hooks.append(lambda req: hook(finished_record(req)))

    # ----- state ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and gauges for /metrics and benchmarks (read without stopping the loop)."""
        core = self.step_loop
        pool, sch = core.pool, core.scheduler
        return {
            **core.counters,
            "running": len(sch.running), "prefilling": len(sch.prefilling),
            "waiting": sum(1 for s in list(sch.waiting) if s.status is Status.WAITING),
            "swapped": sum(1 for s in list(sch.waiting) if s.status is Status.SWAPPED),
            "requests": len(core.requests),
            "kv_pages_device": pool.device_pages - len(pool.free_dev),
            "kv_pages_host": pool.host.shape[0] - len(pool.free_host),
            "kv_pages_index": pool.index_pool.pages_in_use, "kv_pages_limit": core.max_pages,
            "kv_spilled_pages": pool.spilled,
            "prefix_queries": core.prefix.queries, "prefix_hits": core.prefix.hits,
            "prefix_query_tokens": core.prefix.query_tokens, "prefix_hit_tokens": core.prefix.hit_tokens,
            "prefix_hit_rate": core.prefix.hit_rate, "swap_bytes": core.swap_used,
            **self.speculative_stats(),
        }

    def speculative_stats(self) -> dict:
        """With ``speculative``: the rounds' statistics (:class:`~flashrt.engine.speculative.SpecStats`)
        as ``spec_*`` keys; empty without."""
        spec = self.step_loop.spec
        if spec is None:
            return {}
        d = spec.stats.as_dict()
        d.pop("k_counts")
        return {f"spec_{k}": v for k, v in d.items()}
