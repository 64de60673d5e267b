"""Privacy accounting for DP-SGD with `dp-accounting` (Google's library).

DP-SGD with Poisson sampling at rate `q`, Gaussian noise multiplier `sigma` and `T`
steps is the event `SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`. An
accountant turns it into `(epsilon, delta)`: `"rdp"` (Renyi DP, Mironov 2017;
Abadi et al.'s moments accountant) or `"pld"` (privacy loss distributions, tighter
and slower). `dp_noise_multiplier` inverts `dp_epsilon` with
`dp_accounting.calibrate_dp_mechanism`. Nothing is hand-written here.

Sharp edges:
  * `dp-accounting` is an optional dependency (`pip install "oryx_gradlog[dp]"`);
    these functions import it when called.
  * The guarantee is for Poisson sampling (`gl.poisson_batch`) with add-or-remove-one
    neighbouring data sets. Shuffled fixed-size batches are a different event that
    this accounting does not cover.
"""

from __future__ import annotations

_ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting(api: str):
  try:
    import dp_accounting
  except ImportError as error:
    raise ImportError(
        f"{api} needs the package dp-accounting, which is not installed. Install it "
        'with: pip install "dp-accounting>=0.6" (or the extra: pip install '
        '"oryx_gradlog[dp]").') from error
  return dp_accounting


def _check(api: str, sampling_rate: float, steps: int, delta: float, accountant: str):
  bad = []
  if not 0 < sampling_rate <= 1:
    bad.append(f"sampling_rate={sampling_rate!r} must be in (0, 1]")
  if int(steps) != steps or steps < 1:
    bad.append(f"steps={steps!r} must be a positive integer")
  if not 0 < delta < 1:
    bad.append(f"delta={delta!r} must be in (0, 1)")
  if accountant not in _ACCOUNTANTS:
    bad.append(f"accountant={accountant!r} must be one of {_ACCOUNTANTS}")
  if bad:
    raise ValueError(f"{api}: " + "; ".join(bad) + ".")


def _event(dp_accounting, noise_multiplier, sampling_rate, steps):
  step = dp_accounting.PoissonSampledDpEvent(
      sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
  return dp_accounting.SelfComposedDpEvent(step, int(steps))


def _make_accountant(dp_accounting, accountant):
  if accountant == "rdp":
    return dp_accounting.rdp.RdpAccountant
  return dp_accounting.pld.PLDAccountant


def dp_epsilon(*, noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
               accountant: str = "rdp") -> float:
  """Returns the epsilon of DP-SGD at `delta`, from `dp-accounting`.

  Args:
    noise_multiplier: `sigma`, the noise's standard deviation over the clip norm.
    sampling_rate: `q`, the Poisson sampling probability (batch size / data size).
    steps: the number of training steps.
    delta: the target delta (typically below 1 / data size).
    accountant: `"rdp"` or `"pld"`.

  Returns:
    Epsilon (a float; `inf` for `noise_multiplier=0`).

  Example:
    >>> import oryx_gradlog as gl
    >>> eps = gl.dp_epsilon(noise_multiplier=1.1, sampling_rate=0.01, steps=1000,
    ...                     delta=1e-5)
    >>> round(eps, 2)
    1.71
  """
  api = "dp_epsilon"
  _check(api, sampling_rate, steps, delta, accountant)
  if noise_multiplier < 0:
    raise ValueError(f"{api}: noise_multiplier={noise_multiplier!r} must be >= 0.")
  dp_accounting = _dp_accounting(api)
  if noise_multiplier == 0:
    return float("inf")
  counter = _make_accountant(dp_accounting, accountant)()
  counter.compose(_event(dp_accounting, noise_multiplier, sampling_rate, steps))
  return float(counter.get_epsilon(delta))


def dp_noise_multiplier(*, target_epsilon: float, sampling_rate: float, steps: int,
                        delta: float, accountant: str = "rdp") -> float:
  """Returns the smallest noise multiplier whose DP-SGD epsilon is `target_epsilon`.

  Inverts `dp_epsilon` with `dp_accounting.calibrate_dp_mechanism` (a bracketed
  search to within 1e-4, from the side whose epsilon is at most the target).

  Args:
    target_epsilon: the epsilon to reach.
    sampling_rate: `q`, the Poisson sampling probability.
    steps: the number of training steps.
    delta: the target delta.
    accountant: `"rdp"` or `"pld"`.

  Returns:
    `sigma`.

  Example:
    >>> import oryx_gradlog as gl
    >>> sigma = gl.dp_noise_multiplier(target_epsilon=1.71, sampling_rate=0.01,
    ...                                steps=1000, delta=1e-5)
    >>> round(sigma, 2)
    1.1
  """
  api = "dp_noise_multiplier"
  _check(api, sampling_rate, steps, delta, accountant)
  if not target_epsilon > 0:
    raise ValueError(f"{api}: target_epsilon={target_epsilon!r} must be positive.")
  dp_accounting = _dp_accounting(api)
  return float(dp_accounting.calibrate_dp_mechanism(
      _make_accountant(dp_accounting, accountant),
      lambda sigma: _event(dp_accounting, sigma, sampling_rate, steps),
      target_epsilon, delta,
      dp_accounting.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))
