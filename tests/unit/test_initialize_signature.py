"""multihost.initialize takes every argument of jax.distributed.initialize, by the same name and position."""

from __future__ import annotations

import inspect

import jax

import multihost

# Where multihost's default differs from JAX's on purpose (see the
# docstring of multihost.initialize): None means "from the environment, else
# 10 s with failure detection on, else JAX's default".
_OWN_DEFAULTS = {'heartbeat_timeout_seconds': None}


def _params(fn) -> list[inspect.Parameter]:
  return list(inspect.signature(fn).parameters.values())


def test_initialize_takes_every_argument_of_jax_by_name_and_position():
  jax_params = _params(jax.distributed.initialize)
  ours = _params(multihost.initialize)
  head = ours[:len(jax_params)]
  assert [(p.name, p.kind) for p in head] == [
      (p.name, p.kind) for p in jax_params]
  for mine, theirs in zip(head, jax_params, strict=True):
    want = _OWN_DEFAULTS.get(theirs.name, theirs.default)
    assert mine.default == want, (mine.name, mine.default, theirs.default)


def test_initializes_own_options_are_keyword_only():
  jax_names = {p.name for p in _params(jax.distributed.initialize)}
  extras = [p for p in _params(multihost.initialize) if p.name not in jax_names]
  assert [p.name for p in extras] == ['detect_failures']
  assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)


def test_is_initialized_is_jaxs_answer():
  assert multihost.is_initialized() is jax.distributed.is_initialized()
  assert multihost.is_initialized() is False  # this pytest process
