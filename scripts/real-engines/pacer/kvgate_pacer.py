"""Paces a real vLLM or SGLang engine on the CPU like a GPU: each scheduler step takes the time kvgate's
engine model gives a GPU for that step's batch.

Why: on a few shared cores, a fleet of real CPU engines is not a fleet of independent GPUs. An "idle"
engine is no spare capacity, because sending it work takes CPU from the busy one, so latency comparisons
between routers measure the testbed (issue 36). Paced, an engine still runs everything for real (its
scheduler, continuous batching, chunked prefill, prefix cache and eviction, KV events, metrics, load
reports) and still computes the tiny model, but each step then sleeps until the modeled step time has
passed. While it sleeps it takes no CPU, so engines no longer slow each other down, as long as the tiny
model's own compute stays well below the modeled time (the step log below shows whether it does).

The step model is `crates/engine-model`'s `EngineProfile::step_micros`:
`t = a + b*n + c*K/1000 + C/R` milliseconds, with n decode sequences in the step, K their context
tokens, C new (uncached) prefill tokens and R the prefill rate; `scale` multiplies it (wall seconds per
modeled second), for CPUs too slow to keep up with the GPU's own time.

Where a step starts and ends: on vLLM a step starts when the scheduler starts picking its batch
(`Scheduler.schedule`) and its results are released when the modeled time has passed (before
`Scheduler.update_from_output`); on SGLang a step starts at `Scheduler.get_next_batch_to_run` and
its results are released before `Scheduler.process_batch_result`. Tokens, finished requests and KV
events all come out at the paced time. Both are paced with synchronous scheduling only: vLLM without
async scheduling (the CPU default), SGLang with `--disable-overlap-schedule` (see `_pace_sglang`);
anything else is refused at the first step.

Configuration, from the environment (`scripts/real-engines/engine.sh` sets it):
- KVGATE_PACE_PROFILE: the profile as JSON, as `kvgate profile NAME` prints it (needs
  `step_base_ms`, `per_seq_ms`, `per_kilo_context_ms`, `prefill_tokens_per_s`). Pacing is on when set.
- KVGATE_PACE_SCALE: wall seconds per modeled second (default 1).
- KVGATE_PACE_LOG: a file that receives one JSON line per step (optional). Besides the batch and its
  times, a step's line carries `began_at` (the wall time the engine began the step), `admitted`: for
  each request whose prompt first runs in this step, `[arrived, queued, prompt tokens, request id]`,
  and `first_tokens`: the ids of the requests whose prompt this step completes, so whose first token
  it releases at the line's `t`. Arrived is the wall time the engine's API server took the request,
  before rendering and tokenizing it (both engines stamp it; SGLang's does not reach its scheduler by itself, see
  `_carry_sglang_arrival`); queued, when the scheduler put it in its waiting queue, which it does
  between steps. They measure a request's way from the router to the engine's first step
  (`fidelity_common.intake_intervals`). Null where a stamp is missing. The request id is the
  engine's own, which its responses' `id` carries, so a client's records can be joined to these
  (`fidelity_common.ttft_parts`).

`python kvgate_pacer.py step-ms N K C` prints the modeled step time for a batch, unscaled, so tests can
hold this copy of the formula against the Rust one.
"""

import json
import os
import sys
import threading
import time

_VLLM_MODULE = "vllm.v1.core.sched.scheduler"
_VLLM_SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# A step that starts within this long of the last one's release follows it back to back. vLLM
# starts its next step well within 2 ms; SGLang, which processes the last batch's results in
# between, took a median 2.3 ms and a p95 of 17-20 ms after a late step on 2 busy cores (the
# incident's x 8 runs of 2026-12-07).
BACK_TO_BACK_S = 0.020
# How long a paced vLLM engine's queue reader sleeps between polls.
QUEUE_POLL_S = 0.0005
_SGLANG_MODULE = "sglang.srt.managers.scheduler"
_SGLANG_TIME_STATS_MODULE = "sglang.srt.observability.req_time_stats"


class Profile:
    """The step-time parameters of one engine profile."""

    FIELDS = ("step_base_ms", "per_seq_ms", "per_kilo_context_ms", "prefill_tokens_per_s")

    def __init__(self, values):
        missing = [f for f in self.FIELDS if f not in values]
        if missing:
            raise ValueError(f"KVGATE_PACE_PROFILE lacks {', '.join(missing)}")
        for field in self.FIELDS:
            value = values[field]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVGATE_PACE_PROFILE {field} must be a number >= 0, not {value!r}")
        if values["prefill_tokens_per_s"] <= 0:
            raise ValueError("KVGATE_PACE_PROFILE prefill_tokens_per_s must be above 0")
        self.name = str(values.get("name", "unnamed"))
        self.a = float(values["step_base_ms"])
        self.b = float(values["per_seq_ms"])
        self.c = float(values["per_kilo_context_ms"])
        self.r = float(values["prefill_tokens_per_s"])

    def step_ms(self, decode_seqs, decode_context_tokens, prefill_tokens):
        """The modeled step time in milliseconds, rounded to the microsecond as the Rust model does."""
        ms = self.a + self.b * decode_seqs + self.c * decode_context_tokens / 1000.0 + prefill_tokens / self.r * 1000.0
        return max(round(ms * 1000.0), 1) / 1000.0


class Step:
    """One paced step: when the engine began it, when it started on the paced clock (see
    `Pacer.plan`), its batch, its modeled time and when it may end."""

    def __init__(self, began, started, batch, model_ms, deadline):
        self.began = began
        # [arrived, queued, prompt tokens, id] of the requests this step admits, when logged.
        self.admitted = []
        # The ids of the requests whose first token this step releases, when logged.
        self.first_tokens = []
        self.started = started
        self.batch = batch
        self.model_ms = model_ms
        self.deadline = deadline
        self.computed = None


class Pacer:
    """Plans each step's modeled end, holds its results until then, and logs the step."""

    def __init__(self, profile, scale, log_path, runtime):
        self.profile = profile
        self.scale = scale
        self.runtime = runtime
        self.log = open(log_path, "a", buffering=1, encoding="utf-8") if log_path else None
        self.lock = threading.Lock()
        self.steps = 0
        # (deadline, release) of the last step.
        self.last = None

    def plan(self, began, batch):
        """The step of `batch` (decode sequences, their context tokens, prefill tokens) begun at
        `began`, or None for a step that computes nothing.

        A step that follows the last one back to back starts, on the paced clock, when the last one
        should have ended (plus the gap between them), so whatever the last one ran past its end is
        made up by this one, and by the ones after it while that is not enough. Two things make a
        step run past its end that a GPU does not have: an engine sleeping on busy cores wakes a
        few milliseconds late, and a step's own compute can outlast its modeled time (a burst's
        first prefills on four engines at once, on 2 cores). Without this, every later step of the
        busy stretch would end that much later than the GPU's; with it, they end when the GPU's
        would have, as soon as their own compute leaves room. The late step itself stays late:
        its tokens cannot come out before they are computed."""
        if batch[0] == 0 and batch[2] == 0:
            return None
        started = began
        if self.last is not None:
            deadline, released = self.last
            if began - released < BACK_TO_BACK_S:
                started = max(deadline, began - (released - deadline))
        model_ms = self.profile.step_ms(*batch)
        return Step(began, started, batch, model_ms, started + model_ms * self.scale / 1000.0)

    def release(self, step):
        """Sleeps until the step's modeled end (at once when the CPU was slower), then logs it."""
        if step is None:
            return
        now = time.perf_counter()
        if step.computed is None:
            step.computed = now
        # A sleeping engine wakes late when the cores are busy, and a step's compute can outlast
        # its time; the step log shows by how much, and `plan` makes it up.
        if step.deadline > now:
            time.sleep(step.deadline - now)
        done = time.perf_counter()
        self.last = (step.deadline, done)
        self.steps += 1
        if self.log is not None:
            record = {
                "t": round(time.time(), 6),
                "runtime": self.runtime,
                "step": self.steps,
                "decode_seqs": step.batch[0],
                "decode_context": step.batch[1],
                "prefill_tokens": step.batch[2],
                "model_ms": step.model_ms,
                "target_ms": round(step.model_ms * self.scale, 3),
                "compute_ms": round((step.computed - step.began) * 1000.0, 3),
                # From the step's start on the paced clock (see `plan`) to its release.
                "wall_ms": round((done - step.started) * 1000.0, 3),
                # How much of the last step's overrun this one started early to make up.
                "made_up_ms": round((step.began - step.started) * 1000.0, 3),
                "began_at": round(wall_time(step.began), 6),
                "admitted": step.admitted,
                "first_tokens": step.first_tokens,
            }
            with self.lock:
                self.log.write(json.dumps(record) + "\n")


def wall_time(perf_counter_time):
    """A `time.perf_counter()` reading as wall time. Both the pacer and SGLang's request stamps read
    perf_counter, which is the system-wide monotonic clock on Linux, so readings from different
    processes compare."""
    return time.time() - (time.perf_counter() - perf_counter_time)


def _vllm_admitted(scheduler, output):
    """[arrived, queued, prompt tokens, id] of each request a vLLM step schedules for the first time.
    vLLM stamps a request's arrival (wall time) in its API server before rendering and tokenizing
    it; the queueing is stamped by `_pace_vllm`'s `add_request`."""
    admitted = []
    for new in output.scheduled_new_reqs:
        request = scheduler.requests.get(new.req_id)
        if request is not None:
            queued = getattr(request, "_kvgate_queued", None)
            admitted.append(
                [
                    round(request.arrival_time, 6),
                    round(wall_time(queued), 6) if queued is not None else None,
                    request.num_prompt_tokens,
                    new.req_id,
                ]
            )
    return admitted


def _vllm_first_tokens(scheduler, output):
    """The ids of the requests whose prompt a vLLM step completes: it samples their first token. (A
    preempted request recomputing its prompt shows again; its first showing is the one that counts.)"""
    done = []
    for request_id, scheduled in output.num_scheduled_tokens.items():
        request = scheduler.requests.get(request_id)
        if request is None:
            continue
        computed, prompt = request.num_computed_tokens, request.num_prompt_tokens
        if computed - scheduled < prompt <= computed:
            done.append(request_id)
    return done


def _vllm_batch(scheduler, output):
    """(decode sequences, their context tokens, prefill tokens) of a vLLM step. `schedule` has
    already advanced each request's computed tokens by what it scheduled."""
    decode_seqs = decode_context = prefill = 0
    for request_id, scheduled in output.num_scheduled_tokens.items():
        request = scheduler.requests.get(request_id)
        if request is None:
            continue
        before = request.num_computed_tokens - scheduled
        if scheduled == 1 and before >= request.num_prompt_tokens:
            decode_seqs += 1
            decode_context += before + 1
        else:
            # A prompt's chunk, or a preempted request recomputing its tokens: prefill work.
            prefill += scheduled
    return decode_seqs, decode_context, prefill


def _pace_vllm(module, pacer):
    scheduler_cls = module.Scheduler
    schedule, update = scheduler_cls.schedule, scheduler_cls.update_from_output
    add_request = scheduler_cls.add_request

    def stamped_add_request(self, request, *args, **kwargs):
        request._kvgate_queued = time.perf_counter()
        return add_request(self, request, *args, **kwargs)

    def paced_schedule(self, *args, **kwargs):
        if getattr(self, "scheduler_config", None) is not None and getattr(
            self.scheduler_config, "async_scheduling", False
        ):
            raise RuntimeError("kvgate_pacer paces synchronous scheduling only; start vLLM without async scheduling")
        started = time.perf_counter()
        output = schedule(self, *args, **kwargs)
        step = pacer.plan(started, _vllm_batch(self, output))
        if step is not None and pacer.log is not None:
            step.admitted = _vllm_admitted(self, output)
            step.first_tokens = _vllm_first_tokens(self, output)
        self._kvgate_step = (output, step)
        return output

    def paced_update(self, scheduler_output, *args, **kwargs):
        pending = getattr(self, "_kvgate_step", None)
        if pending is not None and pending[0] is scheduler_output:
            self._kvgate_step = None
            pacer.release(pending[1])
        return update(self, scheduler_output, *args, **kwargs)

    scheduler_cls.schedule = paced_schedule
    scheduler_cls.update_from_output = paced_update
    scheduler_cls.add_request = stamped_add_request


def _calm_vllm_queue_polling(module):
    """vLLM's engine core and its model worker pass each step over a shared-memory queue whose
    reader polls in a loop of `sched_yield` for a second after each message. A paced step leaves the
    queue quiet for most of its time, so the reader would poll through every step and take the CPU
    the pacing is meant to free (a paced engine's worker was seen at 73% of a core with 5 ms of
    compute in each 31-ms step). Paced, each poll sleeps 0.5 ms instead of yielding: a message is
    read at most that much later. (Parking the reader on the queue's notification socket instead, as
    vLLM does after a second idle, lost wake-ups at this rate and stalled steps for 5 s.)"""

    def nap():
        time.sleep(QUEUE_POLL_S)

    module.sched_yield = nap


def _sglang_batch(batch):
    """(decode sequences, their context tokens, prefill tokens) of an SGLang batch."""
    mode = batch.forward_mode
    if mode is None or mode.is_idle():
        return 0, 0, 0
    if mode.is_decode():
        seqs = len(batch.reqs)
        context = batch.seq_lens_sum if batch.seq_lens_sum is not None else int(batch.seq_lens_cpu.sum())
        return seqs, int(context), 0
    return 0, 0, int(batch.extend_num_tokens or 0)


def _carry_sglang_arrival(module):
    """SGLang's API server stamps each request when it takes it, before rendering and tokenizing it
    (`created_time`, perf_counter), but does not send the stamp on to its scheduler with the
    request's other times. Paced, the stamp goes along, so the pace log shows a request's way from
    the API server to the scheduler as vLLM's does. (The scheduler copies the API server's times
    into its own by name, and its own has the field.)"""
    stats_cls = module.APIServerReqTimeStats
    getstate = stats_cls.__getstate__

    def getstate_with_arrival(self):
        state = getstate(self)
        if self.created_time:
            state["created_time"] = self.created_time
        return state

    stats_cls.__getstate__ = getstate_with_arrival


def _sglang_admitted(batch, seen):
    """[arrived, queued, prompt tokens, id] of each request an SGLang prefill batch runs for the first
    time (a long prompt runs in several chunks). The scheduler stamps a request when it receives it
    (already tokenized); the API server's stamp reaches it through `_carry_sglang_arrival`. Both
    are perf_counter readings. `seen` holds the requests already admitted; it is cleared when it
    grows large, which can only forget a request still in its prefill."""
    admitted = []
    for req in batch.reqs:
        if req.rid in seen:
            continue
        if len(seen) > 100_000:
            seen.clear()
        seen.add(req.rid)
        stats = getattr(req, "time_stats", None)
        created = getattr(stats, "created_time", 0.0) if stats is not None else 0.0
        received = getattr(stats, "scheduler_recv_time", 0.0) if stats is not None else 0.0
        arrived = round(wall_time(created), 6) if created else None
        queued = round(wall_time(received), 6) if received else None
        admitted.append([arrived, queued, len(req.origin_input_ids), req.rid])
    return admitted


def _sglang_first_tokens(batch):
    """The ids of the requests whose prompt an SGLang prefill batch completes: until its last chunk
    a request counts the chunks in flight before it (`inflight_middle_chunks`; `is_chunked` in
    older SGLang), and its output is not taken; the last samples its first token."""
    done = []
    for req in batch.reqs:
        chunks = getattr(req, "inflight_middle_chunks", None)
        if chunks is None:
            chunks = getattr(req, "is_chunked", 0)
        if chunks <= 0 and not getattr(req, "is_retracted", False):
            done.append(req.rid)
    return done


def _pace_sglang(module, pacer):
    """Paces SGLang's normal loop: schedule, run, process the results. Its overlap loop (the default,
    on the CPU too) launches the next batch before it processes the last one's results; on a GPU that
    launch returns at once, but on the CPU it computes the whole batch first, so the last batch's
    results would come out a CPU step late. Paced engines therefore run with
    `--disable-overlap-schedule`, and the overlap loop is refused."""
    scheduler_cls = module.Scheduler
    next_batch, run_batch = scheduler_cls.get_next_batch_to_run, scheduler_cls.run_batch
    process_result = scheduler_cls.process_batch_result
    seen = set()

    def paced_next_batch(self, *args, **kwargs):
        if not self.server_args.disable_overlap_schedule:
            raise RuntimeError("kvgate_pacer paces SGLang's normal loop only: start it with --disable-overlap-schedule")
        self._kvgate_step_began = time.perf_counter()
        return next_batch(self, *args, **kwargs)

    def paced_run_batch(self, batch, *args, **kwargs):
        began = getattr(self, "_kvgate_step_began", None) or time.perf_counter()
        self._kvgate_step_began = None
        result = run_batch(self, batch, *args, **kwargs)
        batch_shape = _sglang_batch(batch)
        step = pacer.plan(began, batch_shape)
        if step is not None and result is not None:
            step.computed = time.perf_counter()
            if pacer.log is not None and batch_shape[2] > 0:
                step.admitted = _sglang_admitted(batch, seen)
                step.first_tokens = _sglang_first_tokens(batch)
            result._kvgate_step = step
        return result

    def paced_process_result(self, batch, result, *args, **kwargs):
        pacer.release(getattr(result, "_kvgate_step", None))
        return process_result(self, batch, result, *args, **kwargs)

    scheduler_cls.get_next_batch_to_run = paced_next_batch
    scheduler_cls.run_batch = paced_run_batch
    scheduler_cls.process_batch_result = paced_process_result


class _PatchAfterImport:
    """A meta-path finder that patches a scheduler module right after it is first imported, so the
    engine's own start-up code runs unchanged and nothing is imported early."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        if name not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        patch, loader = self.patches[name], spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install():
    """Installs pacing when KVGATE_PACE_PROFILE is set; a bad configuration stops the engine with why."""
    raw = os.environ.get("KVGATE_PACE_PROFILE")
    if not raw:
        return
    try:
        profile = Profile(json.loads(raw))
    except (ValueError, TypeError) as err:
        raise SystemExit(f"kvgate_pacer: KVGATE_PACE_PROFILE is not a usable profile: {err}")
    try:
        scale = float(os.environ.get("KVGATE_PACE_SCALE", "1"))
    except ValueError:
        raise SystemExit(f"kvgate_pacer: KVGATE_PACE_SCALE must be a number, not {os.environ['KVGATE_PACE_SCALE']!r}")
    if not scale > 0 or scale > 1000:
        raise SystemExit(f"kvgate_pacer: KVGATE_PACE_SCALE must be above 0 and at most 1000, not {scale}")
    log = os.environ.get("KVGATE_PACE_LOG") or None
    patches = {
        _VLLM_MODULE: lambda module: _pace_vllm(module, Pacer(profile, scale, log, "vllm")),
        _VLLM_SHM_MODULE: _calm_vllm_queue_polling,
        _SGLANG_MODULE: lambda module: _pace_sglang(module, Pacer(profile, scale, log, "sglang")),
        _SGLANG_TIME_STATS_MODULE: _carry_sglang_arrival,
    }
    sys.meta_path.insert(0, _PatchAfterImport(patches))


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "step-ms":
        raise SystemExit("usage: kvgate_pacer.py step-ms DECODE_SEQS DECODE_CONTEXT PREFILL_TOKENS (profile in KVGATE_PACE_PROFILE)")
    print(Profile(json.loads(os.environ["KVGATE_PACE_PROFILE"])).step_ms(*(int(a) for a in sys.argv[2:])))
