r"""Times multihost's collectives against jax.experimental.multihost_utils.

This file holds the flags and `main`; the benchmark itself is in `bench/`
(harness, collective cases, reference rows, recovery suite, report).

Run under the launcher (process 0 prints the tables):

  python -m multihost.launch --num_processes=2 --devices_per_process=1 -- \
      python bin/bench.py [--json=/tmp/bench.jsonl] [--recovery]

Method:
* Every case runs ours and JAX's implementation in the same run, on the same
  inputs (numpy arrays; broadcast: process 0's data, zeros elsewhere;
  allgather: different data per process; assert_equal: equal data).
* Before any case, one plain jitted all-gather sets up gloo's connections, so
  neither implementation's first call pays that process-wide cost.
* First call: the very first call of each implementation for that case
  (before warm-up; it includes compilation). Ours goes first on even-numbered
  cases, JAX first on odd ones.
* Then `--warmup` untimed calls of each, then `--repeats` timed calls
  (`--small_repeats` for cases of one leaf of at most 1 MiB, calls of about
  a millisecond), alternating ours, jax, ours, jax, ... Before every timed call all processes
  meet at a coordination-service barrier (not timed), so that the calls start
  together. Each process times its own calls; the times are gathered after
  the loop, and each iteration counts the slowest process. Tables show
  medians.
* Outputs: the first call's output of ours and of JAX's are compared on
  every process (tree, shapes, dtypes, values; for cases with no JAX
  equivalent, ours against the expected result); any difference marks the
  row and the run exits with status 1 after printing the tables.
* Extra cases: an explicit is_source, arrival skew (the last process late
  by --skews seconds; the row includes the lateness), mismatched shapes
  (time to our ConsistencyError), and the object collectives against
  pickle + JAX's broadcast_one_to_all/process_allgather of the bytes.
* Peak memory: after timing, one more call of each implementation with the
  kernel's peak-RSS counter reset first (writing "5" to /proc/self/clear_refs
  resets VmHWM); the increase is VmHWM after the call minus VmRSS before it,
  output included, max over processes. "n/a" when /proc does not allow it.
* Reference rows: the coordination-service barrier, a plain jitted all-gather
  and psum of a prebuilt global array, loopback TCP between processes 0 and 1,
  and torch.distributed (gloo) when `import torch` works.
* `--recovery`: checkpoint save + restore + verification of a transition
  state of 2 x --width float32 weights with `recovery.Checkpoints`, against
  plain `orbax.checkpoint.StandardCheckpointer` save + restore of the same
  tree, alternating, on a folder shared by all processes.

The comparison and soak:

* `--versus=ROUNDS`: ours against torch.distributed gloo (when `import
  torch` works) and a raw Python TCP stream (process 0 -> 1, 64 MiB), in
  interleaved rounds (the side that goes first alternates; each round and
  side: a barrier, back-to-back calls, per call, slowest process); at P=2
  it also prints the speed targets (`bench/versus.py`'s TARGETS), met or
  missed.
  The raw stream and an 8-byte Python ping-pong (the round trip a barrier
  cannot beat) are timed in the same rounds. `--versus_busy` times the
  cases up to 1 MiB again with one spinning process per core beside both
  sides (`--versus_busy_placement`: every process starts its share, or
  process 0 all of them). `--versus_side=ours` (or `torch`) times one side
  alone, the other not even imported.
* `--soak=CALLS`: mixed collectives back to back, every process's RSS,
  open fds and threads at 1, 10, 25, 50, 75 and 100% of the calls.
* `--report=FILE`, run without the launcher: `--versus` at P=2, 4 and 8
  (P > 2 oversubscribes the cores; at P=2 also with the CPU busy; at P > 2
  also each side alone, in launches of its own that alternate), the
  soak at P=2, and the model of
  messages and rounds at P=1024 and 4096, as one markdown file, with the
  P-scaling data beside it (/tmp/bench_report.json; `bin/plot.py --scaling`
  draws them):

    python bin/bench.py --report=/tmp/bench_report.md

`--json=FILE` writes JSON Lines: one object per table row, with the keys `op`,
`payload_bytes`, `leaves`, `processes`, `ours_ms`, `jax_ms`, `ratio`,
`ours_first_ms`, `jax_first_ms` (plus `kind`, peak memory and notes).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax

import multihost

# bench/ is not installed: import it from this checkout. The repository root
# goes first, before bin/ (the script's own folder, where this file would
# shadow the package as `bench`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position
from bench import collectives
from bench import harness
from bench import reference
from bench import report
from bench import soak
from bench import versus

# pylint: enable=g-import-not-at-top,wrong-import-position

_SIZES = flags.DEFINE_list(
    'sizes', ['8', '1KiB', '1MiB', '64MiB'],
    'Single-leaf payload sizes per process (B, KiB, MiB).')
_LEAVES = flags.DEFINE_integer(
    'leaves', 100, 'Leaves of the many-leaf tree case (8 B each); 0: skip.',
    lower_bound=0)
_INPUTS = flags.DEFINE_enum(
    'inputs', 'host', ['host', 'device'],
    "Where the single-leaf cases' arrays live: host (numpy arrays) or device "
    "(jax.Arrays on this process's first local device, e.g. its GPU).")
_GLOBAL_SIZES = flags.DEFINE_list(
    'global_sizes', ['1MiB', '64MiB'],
    'Total sizes of the global sharded array cases.')
_OPS = flags.DEFINE_list(
    'ops', [*collectives.OPS, 'reference'],
    'What to run: sync_global_devices, broadcast_one_to_all, '
    'process_allgather, assert_equal, global (sharded global array cases), '
    'source (explicit is_source), skew (late arrivals), mismatch (time to '
    'the error), objects (object collectives), convert (host-local <-> '
    'global round trips), reference (reference rows). Empty: none (e.g. '
    'only --recovery).')
_REPEATS = flags.DEFINE_integer('repeats', 11, 'Timed calls of each '
                                'implementation per case.', lower_bound=1)
_SMALL_REPEATS = flags.DEFINE_integer(
    'small_repeats', 51, 'Timed calls of each implementation per case for '
    'cases of one leaf (or none) of at most 1 MiB (at least --repeats).',
    lower_bound=1)
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed calls of each '
                               'implementation per case, after the first.',
                               lower_bound=0)
_MEMORY = flags.DEFINE_boolean('memory', True,
                               'Measure the peak memory increase per call.')
_JSON = flags.DEFINE_string('json', '', 'Write the rows to this file as JSON '
                            'Lines (process 0).')
_RECOVERY = flags.DEFINE_boolean(
    'recovery', False, 'Also run the recovery benchmark (checkpoint save + '
    'restore + verification vs plain Orbax StandardCheckpointer).')
_WIDTH = flags.DEFINE_integer(
    'width', 32 * 2**20,
    'Recovery benchmark: float32 weights per leaf of the state (two leaves, '
    'weights and momentum); the default makes a 256 MiB state.', lower_bound=1)
_RECOVERY_REPEATS = flags.DEFINE_integer(
    'recovery_repeats', 15, 'Recovery benchmark: timed rounds of each (after '
    'one untimed round of each).', lower_bound=1)
_RECOVERY_SHARDING = flags.DEFINE_multi_enum(
    'recovery_sharding', ['replicated', 'sharded'], ['replicated', 'sharded'],
    'Recovery benchmark: the state leaves replicated on every device (as in '
    'bin/train.py) and/or sharded over all devices; one set of rows each.')
_RECOVERY_DIR = flags.DEFINE_string(
    'recovery_dir', '', 'Recovery benchmark: parent folder of the checkpoint '
    'folders, shared by all processes (default: the temp folder).')
_OBJECT_SIZES = flags.DEFINE_list(
    'object_sizes', ['1KiB', '1MiB', '64MiB'],
    'Sizes of the bytes objects of the object-collective cases.')
_SKEWS = flags.DEFINE_list(
    'skews', ['0.005', '2'], 'Arrival skews of the skew cases, in seconds '
    '(the last process arrives late by this much).')
_SLOW_REPEATS = flags.DEFINE_integer(
    'slow_repeats', 3, 'Timed calls per implementation of the slow cases '
    '(a skew of 0.5 s or more, the mismatch).', lower_bound=1)
_BREAK_OURS = flags.DEFINE_boolean(
    'break_ours', False, 'Testing aid: our broadcast of the first case '
    'returns a wrong value, to show that an output mismatch fails the run.')
_TCP_BYTES = flags.DEFINE_string('tcp_bytes', '64MiB',
                                 'Loopback TCP reference: bytes per transfer.')
_QUICK = flags.DEFINE_boolean(
    'quick', False, 'Tiny smoke run: sizes 8 and 1KiB, 10 leaves, 3 repeats, '
    '1 warm-up, a 1 MiB global array, 1 MiB TCP, recovery width 4096.')
_TIMEOUT = flags.DEFINE_float('timeout', 120.0,
                              'Timeout of every collective, in seconds.')

_VERSUS = flags.DEFINE_integer(
    'versus', 0, 'Interleaved rounds of ours against torch.distributed gloo '
    'and a raw TCP stream (the targets\' cases); at P=2 also prints the '
    'targets met/missed. 0: skip.', lower_bound=0)
_VERSUS_SIZES = flags.DEFINE_list(
    'versus_sizes', ['8', '1MiB', '64MiB'],
    '--versus: the broadcast and all-gather payload sizes.')
_VERSUS_BUSY = flags.DEFINE_boolean(
    'versus_busy', False, 'After --versus, its cases of 1 MiB and less again '
    'with one spinning process per core beside both sides (names end in '
    '"(CPU busy)").')
_VERSUS_BUSY_PLACEMENT = flags.DEFINE_enum(
    'versus_busy_placement', 'every_process', reference.BusyCores.PLACEMENTS,
    '--versus_busy: whose children the spinners are. every_process: each '
    'process starts its share (as a host\'s compute is its controller\'s); '
    'process_0: process 0 starts them all, which with the kernel\'s '
    'autogroup (one fair share per session) contends with process 0 alone.')
_VERSUS_OPS = flags.DEFINE_list(
    'versus_ops', list(versus.OPS),
    f'--versus: the case families ({", ".join(versus.OPS)}).')
_VERSUS_IDLE = flags.DEFINE_boolean(
    'versus_idle', True, '--versus: also the rows with the CPU idle; false: '
    'with --versus_busy, the busy rows alone.')
_VERSUS_SIDE = flags.DEFINE_enum(
    'versus_side', 'both', versus.SIDES,
    '--versus: both (ours and torch gloo in the same processes, interleaved '
    'rounds), or one alone: ours (torch not imported) or torch. '
    '`--report` alternates launches of each alone at P > 2.')
_SOAK = flags.DEFINE_integer(
    'soak', 0, 'Mixed collectives to run back to back, reporting every '
    'process\'s RSS, fds and threads along the way. 0: skip.', lower_bound=0)
_REPORT = flags.DEFINE_string(
    'report', '', 'Run without the launcher: starts --versus at P=2, 4, 8 '
    '(and the soak at P=2) under multihost.launch and writes the targets, '
    'side-by-side, soak, P-scaling and model tables to this markdown file, '
    'and the P-scaling data beside it as JSON (.json for its extension; '
    'bin/plot.py --scaling draws them).')
_REPORT_CASES = flags.DEFINE_enum(
    'report_cases', 'all', ['all', 'contended'], '--report: every part, or '
    'contended: only the broadcasts of 8 B and 1 MiB at P=2 with the CPU '
    'busy and of 8 B at P=4, in the same processes and each side alone.')
_REPORT_ROUNDS = flags.DEFINE_integer('report_rounds', 15,
                                      '--report: rounds at P=2.',
                                      lower_bound=1)
_REPORT_SOAK = flags.DEFINE_integer('report_soak', 100_000,
                                    '--report: soak calls at P=2 (0: none).',
                                    lower_bound=0)

_UNITS = {'': 1, 'b': 1, 'kib': 2**10, 'mib': 2**20, 'gib': 2**30,
          'kb': 10**3, 'mb': 10**6, 'gb': 10**9}


def parse_size(text: str) -> int:
  """'64MiB' -> 67108864; '8' -> 8."""
  s = text.strip().lower()
  digits = s.rstrip('abcdefghijklmnopqrstuvwxyz')
  unit = s[len(digits):]
  if not digits or unit not in _UNITS:
    raise app.UsageError(
        f'Cannot read the size {text!r}; write e.g. 8, 1KiB, 64MiB.')
  return int(float(digits) * _UNITS[unit])


def main(argv):
  del argv  # Unused.
  if _REPORT.value:
    from bench import scaling  # pylint: disable=import-outside-toplevel
    run = (scaling.contended if _REPORT_CASES.value == 'contended'
           else scaling.report)
    print(run(_REPORT.value, rounds=_REPORT_ROUNDS.value,
              soak_calls=_REPORT_SOAK.value), flush=True)
    return
  if _RECOVERY.value:
    import recovery  # pylint: disable=import-outside-toplevel
    recovery.quiet_orbax_logs()
  multihost.initialize()
  if _QUICK.value:
    _quick_defaults()
  ops = _checked_ops()
  if jax.process_count() < 2:
    logging.warning('Running as a single controller: both implementations '
                    'take their one-process fast paths. Run under '
                    '`python -m multihost.launch --num_processes=2`.')
  settings = harness.Settings(repeats=_REPEATS.value,
                              small_repeats=_SMALL_REPEATS.value,
                              warmup=_WARMUP.value,
                              memory=_MEMORY.value, timeout=_TIMEOUT.value)
  sizes = [parse_size(s) for s in _SIZES.value]
  global_sizes = [parse_size(s) for s in _GLOBAL_SIZES.value]
  pid = jax.process_index()
  say = (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)
  say(report.header(settings))

  # Set up gloo's connections once, so no case's first call pays for it.
  collectives.warm_up_gloo()
  harness.barrier(settings)

  f = report.fmt
  rows: list[harness.Row] = []
  start = time.perf_counter()
  cases = collectives.build_cases(ops, sizes, _LEAVES.value, global_sizes,
                                  timeout=settings.timeout,
                                  on_device=_INPUTS.value == 'device')
  cases += collectives.build_extra_cases(
      ops, object_sizes=[parse_size(s) for s in _OBJECT_SIZES.value],
      skews=[float(s) for s in _SKEWS.value], timeout=settings.timeout,
      slow_repeats=_SLOW_REPEATS.value)
  cases += collectives.build_convert_cases(ops, sizes, _LEAVES.value)
  if _BREAK_OURS.value:
    broken = next(c for c in cases if c.op == 'broadcast_one_to_all')
    good = broken.ours
    broken.ours = lambda: jax.tree.map(lambda x: x + 1, good())
  for i, case in enumerate(cases):
    row = harness.run_case(case, i, settings)
    rows.append(row)
    say(f'[{time.perf_counter() - start:6.1f} s] {case.op} {case.payload}: '
        f'ours {f(row.ours_ms)} ms, jax {f(row.jax_ms)} ms, ratio '
        f'{f(row.ratio, 3)}; first {f(row.ours_first_ms)} / '
        f'{f(row.jax_first_ms)} ms {row.note}')
  if 'reference' in ops:
    rows += reference.reference_rows(sizes, _REPEATS.value,
                                     parse_size(_TCP_BYTES.value), settings)
    say(f'[{time.perf_counter() - start:6.1f} s] reference rows done')
  if _RECOVERY.value:
    rows += _recovery_rows(settings)
    say(f'[{time.perf_counter() - start:6.1f} s] recovery benchmark done')
  extra = _versus_and_soak(settings, say)
  if pid == 0:
    print(f'\nLoad average at the end: {report.load()}.\n'
          + ' '.join(['python', *sys.argv]) + '\n' + report.render(rows),
          flush=True)
    if _JSON.value:
      report.write_json(rows, _JSON.value)
      with open(_JSON.value, 'a') as f:
        for row in extra:
          f.write(json.dumps(row) + '\n')
  harness.barrier(settings)
  wrong = [f'{r.op} {r.payload}' for r in rows if r.outputs_equal is False]
  if wrong:
    print(f'{multihost.process_prefix()} OUTPUT MISMATCH: ours '
          f'differs from JAX\'s in {wrong}; the timings of a wrong result '
          'mean nothing.', file=sys.stderr, flush=True)
    sys.exit(1)


def _quick_defaults() -> None:
  """--quick: small sizes and few repeats, for every such flag not given."""
  for name, value in (('sizes', ['8', '1KiB']), ('leaves', 10),
                      ('global_sizes', ['1MiB']), ('repeats', 3),
                      ('small_repeats', 3),
                      ('warmup', 1), ('tcp_bytes', '1MiB'),
                      ('width', 4096), ('recovery_repeats', 1),
                      ('object_sizes', ['1KiB']), ('skews', ['0.005']),
                      ('slow_repeats', 1)):
    if not flags.FLAGS[name].present:
      setattr(flags.FLAGS, name, value)


def _checked_ops() -> list[str]:
  """--ops, once each is known and --width fits a sharded recovery state."""
  known = {*collectives.OPS, 'reference'}
  ops = [o for o in _OPS.value if o]
  unknown = sorted(set(ops) - known)
  if unknown:
    raise app.UsageError(f'--ops: unknown {unknown}; choose from '
                         f'{sorted(known)}.')
  sharded = 'sharded' in _RECOVERY_SHARDING.value
  if _RECOVERY.value and sharded and _WIDTH.value % jax.device_count():
    raise app.UsageError(
        f'--width={_WIDTH.value} must be a multiple of the device count '
        f'({jax.device_count()}) with --recovery_sharding=sharded.')
  return ops


def _recovery_rows(settings: harness.Settings) -> list[harness.Row]:
  """--recovery: the checkpointing rows, per --recovery_sharding layout, and a state sharded 4 ways where the devices allow."""
  # pylint: disable-next=import-outside-toplevel
  from bench import recovery_suite  # Imports recovery and Orbax.
  rows = []
  for layout in _RECOVERY_SHARDING.value:
    rows += recovery_suite.recovery_rows(
        _WIDTH.value, _RECOVERY_REPEATS.value, layout == 'sharded',
        _RECOVERY_DIR.value, settings)
  if jax.device_count() % 4 == 0:  # A state sharded 4 ways.
    rows.append(recovery_suite.sharded_state_row(
        _WIDTH.value, _RECOVERY_REPEATS.value, _RECOVERY_DIR.value,
        settings))
  return rows


def _versus_and_soak(settings: harness.Settings, say) -> list[dict]:
  """--versus and --soak: prints their tables (process 0); returns their JSON rows."""
  out: list[dict] = []
  results = []
  if _VERSUS.value:
    sizes = [parse_size(s) for s in _VERSUS_SIZES.value]
    common = dict(side=_VERSUS_SIDE.value, ops=_VERSUS_OPS.value, say=say)
    if _VERSUS_IDLE.value or not _VERSUS_BUSY.value:
      results = versus.run(_VERSUS.value, settings, sizes=sizes, **common)
    if _VERSUS_BUSY.value:
      results += versus.run(_VERSUS.value, settings, busy=True,
                            sizes=[n for n in sizes if n <= versus.MiB],
                            busy_placement=_VERSUS_BUSY_PLACEMENT.value,
                            **common)
    out += [r.to_json() for r in results]
    say(versus.render(results))
  soak_rows = []
  if _SOAK.value:
    soak_rows = soak.run(_SOAK.value, timeout=settings.timeout, say=say)
    out += soak_rows
    say(soak.render(soak_rows))
  if results and jax.process_count() == 2:
    say(versus.render_targets(versus.targets(results, soak_rows or None)))
  return out


if __name__ == '__main__':
  app.run(main)
