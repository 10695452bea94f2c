"""The step deadline: the learning rule as pure logic, and the report and exit of a stuck step on the in-memory coordination service.

The rule (`liveness.step_rule.Rule`, `Learner`): the first warm-up
steps are never judged; then a step gets max(floor, multiple x the longest
step since the warm-up), which grows with slower steps and never shrinks;
a fixed deadline or none can be set instead. The watch's thread, with two
threads standing for two processes on `fake_coordination`: a step past its
deadline is reported once, naming the process behind and where it is, and
the process leaves with status 75 (recorded here instead); a step that
ends in time, or ends while the others are asked, does not make it leave.
`recovery`'s loop runs each step under the watch unless told not to. The
real-process drills are in tests/multiprocess/test_step_deadline_drills.py.
"""

from __future__ import annotations

import logging
import threading
import time

import fake_coordination as fake
import jax
import numpy as np
import pytest

import multihost
from multihost import env as env_lib
from multihost._src.diagnostics import where
from multihost._src.diagnostics import where_text
from multihost._src.liveness import step_deadline
from multihost._src.liveness import step_rule
from multihost._src.runtime import settings as settings_lib
import recovery

Rule = step_rule.Rule


def _learned(rule, times):
  """The deadline before each step (None: not judged), the step times in `times` observed in turn."""
  learner = step_rule.Learner()
  out = []
  for seconds in times:
    out.append(learner.deadline(rule))
    learner.observe(seconds, rule)
  out.append(learner.deadline(rule))
  return out


# -- the learning rule (pure) -------------------------------------------------


def test_warm_up_steps_are_never_judged_however_long():
  rule = Rule(warmup_steps=3, multiple=5, floor=1)
  # Compilation (100 s) in the warm-up neither is judged nor sets the
  # deadline: the first judged step uses the shortest warm-up step.
  assert _learned(rule, [100.0, 0.5, 0.4]) == [None, None, None, 2.0]


def test_the_deadline_is_the_multiple_of_the_longest_step_seen():
  rule = Rule(warmup_steps=1, multiple=5, floor=1)
  assert _learned(rule, [30.0, 0.4, 0.6, 0.5])[2:] == [2.0, 3.0, 3.0]


def test_the_floor_holds_for_fast_steps():
  rule = Rule(warmup_steps=2, multiple=5, floor=60)
  assert _learned(rule, [9.0, 0.01, 0.02])[2:] == [60.0, 60.0]
  # The defaults: 3 warm-up steps, 5x, at least 60 s.
  assert Rule() == Rule(warmup_steps=3, multiple=5.0, floor=60.0)


def test_the_deadline_grows_with_slower_steps_and_never_shrinks():
  rule = Rule(warmup_steps=1, multiple=4, floor=1)
  got = _learned(rule, [9.0, 1.0, 3.0, 0.5, 0.5])
  assert got[2:] == [4.0, 12.0, 12.0, 12.0]


def test_a_fixed_deadline_after_the_warm_up_or_from_the_first_step():
  assert _learned(Rule(fixed=7, warmup_steps=2), [50.0, 0.1, 99.0]) == [
      None, None, 7.0, 7.0]
  assert _learned(Rule(fixed=7, warmup_steps=0), [0.1]) == [7.0, 7.0]
  # Learned with no warm-up: the floor until a step was seen.
  assert _learned(Rule(warmup_steps=0, floor=2), [1.0]) == [2.0, 5.0]


def test_off_never_judges():
  assert _learned(Rule(enabled=False, warmup_steps=0), [1.0, 500.0]) == [
      None, None, None]


def test_the_explanation_names_the_basis():
  rule = Rule(warmup_steps=1, multiple=5, floor=3)
  learner = step_rule.Learner()
  learner.observe(9.0, rule)
  assert learner.explain(rule) == ('learned: 5 x the shortest of the 1 '
                                   'warm-up steps, 9 s, at least the floor of '
                                   '3 s')
  learner.observe(0.25, rule)
  assert 'the longest step after the warm-up, 0.25 s' in learner.explain(rule)
  assert learner.explain(Rule(fixed=4)) == 'fixed'


@pytest.mark.parametrize('kwargs,says', [
    ({'fixed': 0}, 'fixed step deadline must be a positive'),
    ({'warmup_steps': -1}, 'warmup_steps must be an int >= 0'),
    ({'warmup_steps': 1.5}, 'warmup_steps must be an int >= 0'),
    ({'multiple': 0.5}, 'multiple must be >= 1'),
    ({'floor': 0}, 'floor must be a positive number of seconds'),
])
def test_bad_rules_say_what_to_pass(kwargs, says):
  with pytest.raises(ValueError, match=says) as e:
    Rule(**kwargs)
  assert 'multihost.set_step_deadline(' in str(e.value)


def test_the_environment_sets_the_rule_and_the_program_overrides_it(
    monkeypatch):
  settings = settings_lib.Settings()
  for value, rule in [('', Rule()), ('auto', Rule()),
                      ('off', Rule(enabled=False)), ('0', Rule(enabled=False)),
                      ('120', Rule(fixed=120.0))]:
    monkeypatch.setenv(env_lib.STEP_DEADLINE, value)
    assert step_rule.rule_of(settings) == rule, value
  monkeypatch.setenv(env_lib.STEP_DEADLINE, 'soon')
  with pytest.raises(ValueError, match=r'\$MULTIHOST_STEP_DEADLINE=.soon.'):
    step_rule.rule_of(settings)
  settings.step_deadline = Rule(fixed=9.0)
  assert step_rule.rule_of(settings) == Rule(fixed=9.0)


def test_the_public_setter_and_the_single_process_watch(monkeypatch):
  monkeypatch.delenv(env_lib.STEP_DEADLINE, raising=False)
  watch = multihost.step_watch()
  try:
    multihost.set_step_deadline(fixed=0.01, warmup_steps=0)
    assert watch.deadline() == 0.01
    with watch.step(1):
      watch.arrived()
      assert watch.position()['state'] == 'arrived'
      with pytest.raises(RuntimeError, match='steps do not nest'):
        with watch.step(2):
          pass
      time.sleep(0.05)  # Past the deadline: one process has no one to wait for.
    assert watch.position()['state'] == 'done'
    assert watch._thread is None  # pylint: disable=protected-access
    multihost.set_step_deadline(enabled=False)
    assert watch.deadline() is None
    with pytest.raises(ValueError, match='floor must be'):
      multihost.set_step_deadline(floor=-1)
  finally:
    watch.runtime.settings.step_deadline = None
    watch.configure(step_rule.rule_of(watch.runtime.settings))


# -- the thread: two processes on the in-memory service ----------------------


@pytest.fixture
def pair():
  """Two fake processes whose watches record their exit instead of leaving (rule: fixed 0.4 s, no warm-up)."""
  _, rts = fake.runtimes(2)
  exits = {0: [], 1: []}
  for rt in rts:
    rt.where.ensure_started()
    rt.step_watch = step_deadline.StepWatch(
        rt, ask=lambda ps, rt=rt: where.ask(ps, runtime=rt),
        describe=lambda r: where_text.whereabouts(r, where.ANSWER_WITHIN_S),
        leave=exits[rt.index].append)
    rt.step_watch.configure(Rule(fixed=0.4, warmup_steps=0))
  yield rts, exits
  for rt in rts:
    rt.step_watch.stop()
  fake.stop(rts)


def _wait_for(predicate, timeout):
  deadline = time.monotonic() + timeout
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.02)
  return predicate()


def test_a_stuck_step_names_the_process_behind_and_leaves_with_75(
    pair, caplog):
  rts, exits = pair
  caplog.set_level(logging.WARNING)
  release = threading.Event()
  # Process 1 stalls in its data loader in step 5; process 0 has its batch
  # and waits in the step's collective (here: for the test to end).
  one = threading.Thread(target=lambda: _in_step(rts[1], 5, release,
                                                 arrive=False), daemon=True)
  zero = threading.Thread(target=lambda: _in_step(rts[0], 5, release,
                                                  arrive=True), daemon=True)
  started = time.monotonic()
  zero.start()
  one.start()
  try:
    assert _wait_for(lambda: exits[0] and exits[1], 10), exits
    took = time.monotonic() - started
  finally:
    release.set()
    zero.join(5)
    one.join(5)
  assert exits == {0: [75], 1: [75]}
  assert took < 0.4 + step_deadline.ASK_BOUND_S, took
  line = rts[0].step_watch.fired
  assert line.startswith('[process=0] multihost: step 5 has run for '), line
  assert 'past its deadline of 0.4 s (fixed)' in line, line
  assert ('Behind the others: process 1 is in step 5 for ' in line
          and ', not arrived at its collective part (process(es) [0]: in '
          'step 5' in line), line
  # (Threads stand for processes here: every "main thread" is the test's.)
  assert 'Where they are: process 1: main thread in ' in line, line
  assert 'Leaving with exit status 75' in line, line
  assert '$MULTIHOST_STEP_DEADLINE' in line, line
  # The stuck process says that it is the one behind.
  assert 'process 1 (this process) is in step 5' in rts[1].step_watch.fired
  # One line each, logged.
  logged = [r.getMessage() for r in caplog.records
            if 'past its deadline' in r.getMessage()]
  assert sorted(m[:12] for m in logged) == ['[process=0] ', '[process=1] ']


def _in_step(rt, n, release, *, arrive):
  with rt.step_watch.step(n):
    if arrive:
      rt.step_watch.arrived()
      release.wait(20)
    else:  # Stuck in its data loader.
      release.wait(20)


def test_a_process_between_steps_is_behind_one_in_the_next_step(pair):
  rts, exits = pair
  w0, w1 = rts[0].step_watch, rts[1].step_watch
  for n in (1, 2):  # Both take steps 1 and 2 in time.
    for w in (w0, w1):
      with w.step(n):
        pass
  w1.configure(Rule(enabled=False))  # Process 1 stays quiet here.
  with w0.step(3):
    assert _wait_for(lambda: exits[0], 6), exits
  assert exits == {0: [75], 1: []}
  line = w0.fired
  assert 'step 3 has run for' in line, line
  assert ('Behind the others: process 1 is between steps: step 2 ended '
          in line), line
  assert '(process(es) [0]: in step 3 for ' in line, line


def test_a_process_stuck_between_steps_is_judged_and_named(pair):
  """Process 1 did step 5's work (`between`) and stalls in its code after it (a callback, a signal handler); process 0 waits in step 6: both leave with 75, and process 0 names process 1, between steps."""
  rts, exits = pair
  w0, w1 = rts[0].step_watch, rts[1].step_watch
  release = threading.Event()

  def one():
    w1.begin(5)
    w1.arrived()
    w1.between()  # Its step's own work done; then stuck.
    release.wait(20)

  thread = threading.Thread(target=one, daemon=True)
  started = time.monotonic()
  thread.start()
  try:
    with w0.step(6):
      w0.arrived()
      assert _wait_for(lambda: exits[0] and exits[1], 10), exits
    took = time.monotonic() - started
  finally:
    release.set()
    thread.join(5)
  assert exits == {0: [75], 1: [75]}
  assert took < 0.4 + step_deadline.ASK_BOUND_S, took
  line = w0.fired
  assert ('Behind the others: process 1 is between steps: in the '
          "program's code after step 5 for " in line), line
  assert 'Where they are: process 1: main thread in ' in line, line
  assert w1.fired.startswith('[process=1] multihost: step 5 has run for '), (
      w1.fired)
  w1.end()


def test_a_step_that_raises_after_a_peer_left_at_its_deadline_leaves_75(
    pair):
  """Process 1, stuck between steps, left at its deadline (its report in the store); process 0's collective then raised, before its own deadline: it leaves with 75 too, naming process 1."""
  rts, exits = pair
  w1 = rts[1].step_watch
  w1.begin(5)
  w1.between()
  left = {1: where.local_report(rts[1])}
  w0 = step_deadline.StepWatch(
      rts[0], ask=lambda ps: where.ask(ps, runtime=rts[0]),
      describe=lambda r: where_text.whereabouts(r, where.ANSWER_WITHIN_S),
      leave=exits[0].append, left_reports=lambda: left)
  w0.configure(Rule(fixed=30.0, warmup_steps=0))
  own, rts[0].step_watch = rts[0].step_watch, w0  # Its where-report's.
  try:
    w0.begin(6)
    w0.arrived()
    started = time.monotonic()
    w0.end(RuntimeError('the collective failed: the peer left'))
    took = time.monotonic() - started
  finally:
    w0.stop()
    w1.end()
    rts[0].step_watch = own
  assert exits[0] == [75], exits
  assert took < step_deadline.ASK_BOUND_S + 2, took
  line = w0.fired
  assert line.startswith('[process=0] multihost: step 6 raised after '), line
  assert 'as process(es) [1] left at their step deadline' in line, line
  assert ('Behind the others: process 1 is between steps: in the '
          "program's code after step 5 for ") in line, line


def test_between_keeps_the_step_judged_until_the_next_begin():
  watch = multihost.step_watch()
  before = watch.learner.steps
  watch.begin(7)
  watch.between()
  try:
    assert watch.position()['state'] == 'between'
  finally:
    watch.begin(8)  # Ends step 7 (completed, learned from), begins 8.
  assert (watch.position()['step'], watch.position()['state']) == (
      8, 'preparing')
  assert watch.learner.steps == before + 1
  with pytest.raises(RuntimeError, match='steps do not nest'):
    watch.begin(9)  # Step 8 is not marked between.
  watch.end()
  assert watch.learner.steps == before + 2


def test_a_process_yet_to_read_the_step_before_is_stuck_on_that_step(pair):
  """Process 0 dispatched step 5 and is in step 6, still to read step 5's result (an overlapped check); process 1 is stuck loading step 5: process 0 reports step 5, awaited in step 6."""
  rts, exits = pair
  w0 = rts[0].step_watch
  ready = []
  with w0.step(5):
    w0.arrived()
  w0.awaiting(5, lambda: bool(ready))
  release = threading.Event()
  one = threading.Thread(target=lambda: _in_step(rts[1], 5, release,
                                                 arrive=False), daemon=True)
  one.start()
  try:
    with w0.step(6):
      w0.arrived()
      place = w0.position()
      ready.append(True)  # Once step 5's result is ready: in step 6 again.
      assert w0.position()['step'] == 6
      ready.clear()
      assert _wait_for(lambda: exits[0], 10), exits
  finally:
    release.set()
    one.join(5)
  assert place['step'] == 5 and place['state'] == 'arrived', place
  assert place['in'] == 6 and place['for'] >= 0, place
  line = w0.fired
  assert line.startswith('[process=0] multihost: step 5 has run for '), line
  assert ('Behind the others: process 1 is in step 5 for ' in line
          and '(process(es) [0]: in step 5 for ' in line
          and ' (its result awaited in step 6), arrived' in line), line
  w0.awaiting(None)  # Read: step 6 again.
  assert w0.position()['step'] == 6 and 'in' not in w0.position()


def _slowly_asking(rt, exits, rule):
  """A watch (under `rule`) whose question to the others takes 0.5 s, and the event set when it is asked."""
  asked = threading.Event()

  def slow_ask(processes):
    asked.set()
    time.sleep(0.5)
    return {p: None for p in processes}

  watch = step_deadline.StepWatch(rt, ask=slow_ask, describe=lambda r: '',
                                  leave=exits.append)
  watch.configure(rule)
  return watch, asked


def test_steps_in_time_or_ending_during_the_report_never_leave(pair, caplog):
  rts, exits = pair
  w0 = rts[0].step_watch
  for n in range(1, 6):  # Each well inside 0.4 s.
    with w0.step(n):
      time.sleep(0.02)
  time.sleep(0.6)
  assert exits[0] == [] and w0.fired is None

  # A step past its deadline that ends while the others are asked: slow,
  # not stuck. It is logged, learned from, and the process stays.
  caplog.set_level(logging.WARNING)
  slow, asked = _slowly_asking(rts[0], exits[0],
                               Rule(warmup_steps=0, floor=0.3, multiple=1))
  try:
    with slow.step(1):
      assert asked.wait(5)
    time.sleep(0.7)
    assert exits[0] == [] and slow.fired is None
    assert any('step 1 ran for over' in r.getMessage()
               and 'but ended: not leaving'
               in r.getMessage() for r in caplog.records), caplog.text
    assert slow.deadline() >= 0.3
  finally:
    slow.stop()


def test_a_step_that_raises_while_it_is_reported_still_leaves_with_75(
    pair, caplog):
  """The stuck peer left first, so this process's collective raised while its report was being made: it leaves with 75 all the same, not with that error."""
  rts, exits = pair
  caplog.set_level(logging.WARNING)
  watch, asked = _slowly_asking(rts[0], exits[0],
                                Rule(fixed=0.2, warmup_steps=0))
  try:
    with pytest.raises(RuntimeError, match='the peer left'):
      with watch.step(7):
        watch.arrived()
        assert asked.wait(5)
        raise RuntimeError('the collective failed: the peer left')
    assert exits[0] == [75], exits
    assert 'step 7 has run for' in watch.fired, watch.fired
    assert any('step 7 raised past its deadline of 0.2 s (RuntimeError: '
               'the collective failed' in r.getMessage()
               for r in caplog.records), caplog.text
  finally:
    watch.stop()


def test_an_unanswered_ask_is_bounded(pair, monkeypatch):
  rts, exits = pair
  monkeypatch.setattr(step_deadline, 'ASK_BOUND_S', 0.5)
  hang = threading.Event()
  watch = step_deadline.StepWatch(
      rts[0], ask=lambda ps: hang.wait(30),
      describe=lambda r: where_text.whereabouts(r, 0.5),
      leave=exits[0].append)
  watch.configure(Rule(fixed=0.2, warmup_steps=0))
  try:
    started = time.monotonic()
    with watch.step(4):
      assert _wait_for(lambda: exits[0], 5)
    assert time.monotonic() - started < 0.2 + 0.5 + 1.0
    assert 'Who is behind is unknown: no other process answered' in watch.fired
    assert 'process 1: not answering within 0.5 s' in watch.fired
  finally:
    hang.set()
    watch.stop()


# -- recovery's loop ----------------------------------------------------------


def _replicated() -> jax.sharding.NamedSharding:
  """Replicated over a mesh of this process's first device."""
  return jax.sharding.NamedSharding(
      jax.make_mesh((1,), ('d',), devices=jax.devices()[:1]),
      jax.sharding.PartitionSpec())


def _counting_loop(data_fn, rep):
  """A ResilientLoop adding each batch to a scalar (8 samples, batches of 2), and its state at step 0."""
  loop = recovery.ResilientLoop(
      jax.jit(lambda user, batch: (user + batch, batch)), data_fn=data_fn,
      sampler=recovery.EpochSampler(8, 2))
  return loop, loop.init(jax.device_put(np.float32(0), rep),
                         jax.random.key(0))


def test_recovery_s_loop_watches_each_step_unless_told_not_to():
  rep = _replicated()
  seen = []

  def data_fn(ids):
    seen.append(multihost.step_watch().position())
    return jax.device_put(np.float32(len(ids)), rep)

  loop, state = _counting_loop(data_fn, rep)
  watch = multihost.step_watch()
  before = watch.learner.steps
  state = loop.run(state, until_step=3).state
  # Inside step n while loading its batch, arrived after it, learned from.
  assert [(p['step'], p['state']) for p in seen] == [
      (1, 'preparing'), (2, 'preparing'), (3, 'preparing')]
  assert watch.learner.steps == before + 3
  assert watch.position()['step'] == 3 and watch.position()['arrivals']
  loop.run(state, until_step=5, step_deadline=False)
  assert watch.learner.steps == before + 3
  assert watch.position()['step'] == 3


def test_recovery_s_loop_watches_the_code_between_its_steps_too():
  """`on_step` (and the saves, the preemption check) run inside the step just taken: the window has no gap until the loop ends."""
  rep = _replicated()
  seen = []
  loop, state = _counting_loop(
      lambda ids: jax.device_put(np.float32(len(ids)), rep), rep)
  watch = multihost.step_watch()
  loop.run(state, until_step=3,
           on_step=lambda s, r: seen.append(watch.position()))
  assert [(p['step'], p['state']) for p in seen] == [
      (1, 'between'), (2, 'between'), (3, 'between')], seen
  assert watch.position()['state'] == 'done'  # The loop's end closes it.


@pytest.mark.parametrize('overlap', [False, True])
def test_an_overlapped_check_leaves_the_next_step_stuck_on_its_step(overlap):
  """With `overlap_check`, until a step's held check reads its result, the next step is stuck on it (a result that is not a jax.Array is never ready)."""
  seen, checked = [], []

  def data_fn(ids):
    seen.append(multihost.step_watch().position())
    return np.float32(len(ids))

  loop = recovery.ResilientLoop(
      lambda user, batch: (user + batch, np.float32(batch)), data_fn=data_fn,
      sampler=recovery.EpochSampler(8, 2), overlap_check=overlap,
      check_fn=lambda *a: checked.append(multihost.step_watch().position()))
  state = loop.init(np.float32(0), jax.random.key(0))
  loop.run(state, until_step=3)
  if overlap:  # Step 3 settles (the last): its check in its own step.
    assert [(p['step'], p.get('in')) for p in seen] == [
        (1, None), (1, 2), (2, 3)], seen
    assert [(p['step'], p.get('in')) for p in checked] == [
        (1, 2), (2, 3), (3, None)], checked
  else:
    assert [(p['step'], p.get('in')) for p in seen + checked] == [
        (1, None), (2, None), (3, None)] * 2, seen
  assert 'in' not in multihost.step_watch().position()


def test_begin_and_end_mark_a_step_as_its_with_block_does():
  watch = multihost.step_watch()
  before = watch.learner.steps
  watch.begin(7)
  try:
    assert watch.position()['state'] == 'preparing'
    with pytest.raises(RuntimeError, match='steps do not nest'):
      watch.begin(8)
    watch.arrived()
    assert watch.position()['state'] == 'arrived'
  finally:
    watch.end()
  assert (watch.position()['step'], watch.position()['state']) == (7, 'done')
  assert watch.learner.steps == before + 1  # Completed: learned from.
  watch.begin(8)
  watch.end(ValueError('the step raised'))
  assert (watch.position()['step'], watch.position()['state']) == (8, 'done')
  assert watch.learner.steps == before + 1  # Raised: not learned from.


def test_recovery_s_loop_ends_a_step_that_raises():
  rep = _replicated()
  loads = []

  def data_fn(ids):
    loads.append(len(loads) + 1)
    if len(loads) == 2:
      raise ValueError('no batch for step 2')
    return jax.device_put(np.float32(len(ids)), rep)

  loop, state = _counting_loop(data_fn, rep)
  watch = multihost.step_watch()
  before = watch.learner.steps
  with pytest.raises(ValueError, match='no batch for step 2'):
    loop.run(state, until_step=4)
  # Step 2 ended with its error (not learned from); the next run's steps
  # begin as usual.
  assert (watch.position()['step'], watch.position()['state']) == (2, 'done')
  assert watch.learner.steps == before + 1
  assert loop.run(state, until_step=2).state.step == 2
  assert watch.learner.steps == before + 3
