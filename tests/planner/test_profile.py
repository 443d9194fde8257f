"""Profile: the one typed profile format (the runtime writes it, coci-plan reads it)."""
import json

import pytest

from coci_hpc.errors import InputFormatError
from coci_hpc.planner.profile import Profile, Sample


def test_roundtrip_and_derived_step_time(tmp_path):
    p = Profile((Sample(10, 5.0, 2.0), Sample(20, 10.0, 1.5), Sample(30, 15.0, 1.2)),
                ckpt_cost_s=1.5, persist_s=20.0, total_steps=1000)
    path = tmp_path / "prof.json"
    p.save(str(path))
    q = Profile.load(str(path))
    assert q == p
    assert q.measured_step_time() == pytest.approx(0.5)
    assert q.t_now() == 15.0 and q.step_now() == 30
    assert json.loads(path.read_text())["persist_s"] == 20.0


@pytest.mark.parametrize("doc,needle", [({"samples": [{"time_s": "x", "loss": 1}]}, "samples[0]"),
                                        ({"samples": [], "persist_s": "slow"}, "persist_s"),
                                        ({"samples": [], "total_steps": -3}, "total_steps"),
                                        ([1, 2], "samples")])
def test_bad_profiles_name_the_field(doc, needle):
    with pytest.raises(InputFormatError) as ei:
        Profile.from_dict(doc)
    assert needle in str(ei.value) and ei.value.hint
