"""How close a CP run must be to the single-process reference, on whatever device its ranks ran.

1e-4 of the reference's scale holds where the GEMMs give a row the same values whatever else is in the
batch (a CPU: they differ at most in fp32's last bits where the thread split changes). Beyond that the
device's own floor decides, measured as the GPU check measures it (:mod:`layersplit.gpu_check.agreement`:
the reference re-run over other row splits; ``FLOOR_FACTOR`` x its largest deviation, never below 1e-4).
On a CPU that floor is ~3.5e-6, so the bound stays 1e-4 and a defect fails as before; on a GPU, where a
rank's projections of its own rows may differ in their last bits from the reference's and flip a bf16
or e4m3 rounding (the fp8 bytes then differ too), the bound is the one the GPU check holds the engine to.
No device branch: the measurement decides, and is taken only when 1e-4 does not hold.
"""

from __future__ import annotations

import math

from layersplit.gpu_check.agreement import CPU_TOL, rel_deviation, row_split_floor, tolerance


def assert_matches_reference(model, scenario, res, ref, name: str = "") -> float:
    """``res`` (a CP run of ``scenario``) against ``ref`` (its reference): no NaN, then within 1e-4 of the
    reference's scale or, failing that, within the row-split floor measured here. Returns the deviation."""
    rel = rel_deviation(res.hidden, ref.hidden)
    assert not math.isinf(rel), f"{name}: NaN in the CP output"
    if rel <= CPU_TOL:
        return rel
    floor = row_split_floor(model, scenario, ref.hidden)["floor"]
    assert rel <= tolerance(floor), (f"{name}: relative deviation {rel:.2e} > max({CPU_TOL:g}, row-split floor "
                                     f"{floor:.1e} x 10) on this device")
    return rel
