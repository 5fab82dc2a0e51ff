"""A hostile caller's session: what a call returns, or a failure in the middle of another call, changes no cache behind
the caller's back, and mixed operations on several caches of one model give what each gives alone."""

from __future__ import annotations

import pytest
import torch

from fault_injection import assert_same, snapshot
from tiny_models import tiny_ccm


@pytest.mark.parametrize("return_dict_in_generate", [False, True])
def test_changing_the_returned_ids_in_place_leaves_the_cache_as_generate_left_it(return_dict_in_generate):
    """The cache kept the last generated token (the one compress() folds, not yet run) as a view of the ids generate()
    returned: a caller that padded its reply's end in place (`out[:, -1] = pad_id`) changed the token its memory was
    then made of, without a word. The cache holds a copy."""
    model = tiny_ccm("llama", update="concat")
    changed = model.new_cache(2)
    model.compress(changed, torch.tensor([[5, 6, 7], [8, 9, 10]]))
    untouched = changed.copy()
    prompt = torch.tensor([[20, 21], [22, 23]])
    outputs = [
        model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=3,
            do_sample=False,
            return_dict_in_generate=return_dict_in_generate,
        )
        for cache in (changed, untouched)
    ]
    assert not torch.equal(changed.pending_ids, torch.zeros_like(changed.pending_ids))  # the change is one
    returned = outputs[0].sequences if return_dict_in_generate else outputs[0]
    returned.zero_()
    assert_same(snapshot(changed), snapshot(untouched))
    for cache in (changed, untouched):
        model.compress(cache)
    assert_same(snapshot(changed), snapshot(untouched))
