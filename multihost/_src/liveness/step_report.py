"""Liveness: the report of a stuck step, in one line: where each process is in its steps, who is behind, and why it leaves.

Pure: it renders the where-reports that `liveness.step_deadline` collects
(each with the process's place in its steps, `StepWatch.position`; None
for a process that did not answer) and asks nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from multihost import env as _env
from multihost._src.liveness import peer_loss_exit

# Where a step stands, in order: a process at a smaller (step, place) is
# behind one at a larger.
_PLACES = {'preparing': 0, 'arrived': 1, 'between': 2, 'done': 3}


def place(position: dict | None,
          now_in: dict | None = None) -> tuple[int, int, int] | None:
  """A where-report's step position as an order: a smaller one is behind.

  Between steps (`StepWatch.between`), a process waiting in a collective
  (`now_in`, from its where-report) is ahead of one that is not: the
  collective waits for it.
  """
  if not position:
    return None
  state = position['state']
  return (position['step'], _PLACES[state],
          int(state == 'between' and now_in is not None))


def position_text(position: dict, *, arrivals: bool | None = None) -> str:
  """A step position in words: 'in step 5 for 3.1 s, not arrived at its collective part'.

  Args:
    position: a where-report's step position (`StepWatch.position`).
    arrivals: whether the program marks arrivals (`StepWatch.arrived`);
      None: whether this process has marked one.
  """
  n, state, seconds = position['step'], position['state'], position['for']
  if state == 'done':
    return f'between steps: step {n} ended {seconds:.1f} s ago'
  if state == 'between':  # See `StepWatch.between`.
    return (f'between steps: in the program\'s code after step {n} for '
            f'{seconds:.1f} s')
  text = f'in step {n} for {seconds:.1f} s'
  if position.get('in') is not None:  # See `StepWatch.awaiting`.
    text += f' (its result awaited in step {position["in"]})'
  if position['arrivals'] if arrivals is None else arrivals:
    text += (', arrived at its collective part' if state == 'arrived' else
             ', not arrived at its collective part')
  return text


def report(prefix: str, me: int, n: int, *, took: float, due: float,
           why: str, reports: dict[int, dict | None],
           describe: Callable[[dict[int, dict | None]], str],
           raised: bool = False) -> str:
  """The one line of a stuck step: the step, how long, the deadline, who is behind and where.

  `raised`: the step raised before its deadline, after a peer left at its
  own (`StepWatch.end`): its collective failed as the stuck peer left.
  """
  places = {p: place(r.get('step'), r.get('now_in'))
            for p, r in reports.items() if r is not None}
  known = {p: k for p, k in places.items() if k is not None}
  answered = {p: r for p, r in reports.items() if r is not None}
  # A process that never got as far as marking an arrival is behind those
  # that did: the program marks them if any process does.
  arrivals = any(answered[p]['step']['arrivals'] for p in known)
  lead = max(known.values()) if known else None
  behind = sorted(p for p, k in known.items()
                  if lead is not None and k < lead)
  silent = sorted(p for p, r in reports.items() if r is None)
  if raised:
    left = sorted(p for p, r in reports.items()
                  if r is not None and r.get('left'))
    parts = [f'{prefix} multihost: step {n} raised after {took:.1f} s on '
             f'this process, as process(es) {left} left at their step '
             f'deadline (of {due:.3g} s here: {why}).']
  else:
    parts = [f'{prefix} multihost: step {n} has run for {took:.1f} s on '
             f'this process, past its deadline of {due:.3g} s ({why}).']
  if behind:
    who = '; '.join(
        f'process {p}{" (this process)" if p == me else ""} is '
        f'{position_text(answered[p]["step"], arrivals=arrivals)}'
        f'{" (then left at its step deadline)" if answered[p].get("left") else ""}'
        for p in behind)
    ahead = sorted(p for p, k in known.items() if k == lead)
    parts.append(f'Behind the others: {who} (process(es) {ahead}: '
                 f'{position_text(answered[ahead[0]]["step"], arrivals=arrivals)}'
                 ').')
    shown = behind
  elif len(known) < 2:
    parts.append('Who is behind is unknown: no other process answered (one '
                 'that left first, having found this step stuck, does not).')
    shown = []
  else:
    parts.append(f'No process that answered is behind: they are all at the '
                 f'same point of step {n} (a step slow everywhere, or stuck '
                 'in a device collective).')
    shown = [p for p in known if p != me]
  shown = sorted(set(shown) | set(silent))
  if shown:
    parts.append(describe({p: reports[p] for p in shown}))
  parts.append(
      f'Leaving with exit status {peer_loss_exit.EXIT_STATUS} so that the '
      'job restarts (python -m multihost.launch --max_restarts=N does, as '
      'does a scheduler\'s requeue). A step that is slow rather than stuck '
      'needs a larger deadline: multihost.set_step_deadline(fixed=SECONDS) '
      f'or ${_env.STEP_DEADLINE}=SECONDS (0: off).')
  return ' '.join(parts)
