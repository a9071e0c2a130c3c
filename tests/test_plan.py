"""Planner: grouping by system prompt, deterministic order, windows, and the prefix-share bound."""
from __future__ import annotations

from runner.plan import GroupSummary, PlanSummary, PrefixCacheBound, group_key, plan_stream, plan_window, summarize_plan
from runner.prompting import Document, PromptBuilder


def docs(spec: str) -> list[Document]:
    """'AABAC' -> rows r0..r4 whose system prompts are 'A', 'A', 'B', ..."""
    return [Document(f"r{i}", f"text {i}", f"system {c}", {}) for i, c in enumerate(spec)]


def order(groups) -> list[str]:
    return [d.row_id for g in groups for d in g.docs]


def test_rows_sharing_a_prompt_run_together_in_first_appearance_order():
    groups = plan_window(docs("ABACBA"))
    assert [g.system_prompt for g in groups] == ["system A", "system B", "system C"]
    assert order(groups) == ["r0", "r2", "r5", "r1", "r4", "r3"]


def test_group_key_is_stable_and_distinct():
    assert group_key("x") == group_key("x") != group_key("y")
    assert group_key(None) == group_key("") == "none"


def test_windows_bound_grouping_and_continue_the_last_group():
    # window 1: A A B -> [A A][B]; window 2 starts with B (the group that ran last), then A.
    groups = list(plan_stream(docs("AABABA"), window_rows=3))
    assert order(groups) == ["r0", "r1", "r2", "r4", "r3", "r5"]
    assert [g.system_prompt for g in groups] == ["system A", "system B", "system B", "system A"]


def test_done_rows_are_left_out():
    groups = list(plan_stream(docs("ABAB"), window_rows=10, skip_ids={"r0", "r3"}))
    assert order(groups) == ["r1", "r2"]  # B appears first among what is left


def test_prefix_bound_counts_whole_blocks_seen_before_like_vllm():
    b = PrefixCacheBound(block_tokens=4)
    first = list(range(10))
    assert b.add(first) == 0  # nothing cached yet
    assert b.add(first) == 8  # two whole blocks; the last prompt token is always computed
    assert b.add(list(range(8))) == 4  # 8 tokens: the second block would hold the last token
    assert b.add([0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4  # diverges in block 2
    assert b.add([9, 1, 2, 3, 4, 5, 6, 7, 8]) == 0  # a block counts only after its whole prefix
    assert b.add([0, 1, 2, 3, 9, 9, 9, 9, 9, 9]) == 8  # the diverging branch was cached too
    assert PrefixCacheBound(block_tokens=16).add(first) == 0


def test_prefix_share_sums_cacheable_over_prompt_tokens():
    g = GroupSummary("k", "", rows=3, prompt_tokens=300, cacheable_tokens=64)
    assert PlanSummary([g], True).prefix_share == 64 / 300
    assert PlanSummary([], True).prefix_share == 0


def test_summary_counts_real_tokens_per_group(model_dir):
    b = PromptBuilder(model_dir)
    long_a, long_b = "Rules for A. " * 40, "Rules for B. " * 40
    rows = [Document(f"r{i}", f"doc {i}", long_a if i % 2 else long_b, {}) for i in range(6)]
    s = summarize_plan(rows, b)
    assert s.rows == 6 and len(s.groups) == 2 and s.tokens_exact
    prompt0 = b.encode(b.render(long_b, "doc 0"))
    assert s.groups[0].prompt_tokens == sum(len(b.encode(b.render(long_b, f"doc {i}"))) for i in (0, 2, 4))
    assert 100 < s.groups[0].prefix_tokens < len(prompt0)
    assert 0.5 < s.prefix_share < 1


def test_without_a_tokenizer_the_bound_is_estimated_from_each_groups_system_prompt():
    """Every row after a group's first reuses the whole blocks of its system prompt (~4 chars a token)."""
    long_a = "Rules for A. " * 40  # 520 chars: ~130 tokens, 4 whole 32-token blocks
    rows = [Document(f"r{i}", "doc", long_a if i < 5 else "short", {}) for i in range(7)]
    s = summarize_plan(rows, None, block_tokens=32, batch=2)  # batches split group A: its first row counts once
    assert not s.tokens_exact and [g.rows for g in s.groups] == [5, 2]
    assert s.groups[0].prefix_tokens == 130 and s.groups[0].cacheable_tokens == 4 * 128
    assert s.groups[1].cacheable_tokens == 0  # a prompt shorter than a block shares nothing
    assert s.prefix_share == 4 * 128 / s.prompt_tokens


def test_the_estimate_counts_few_shot_turns_and_the_user_templates_fixed_head_as_shared():
    """No system prompt, but long few-shot turns and instructions before the document: most of each
    prompt is shared, and the estimate says so."""
    from runner.plan import CharEstimate

    est = CharEstimate("Instructions: " + "be brief. " * 50 + "{{literal}}\nDocument: {text}",
                       examples=[{"role": "user", "content": "x" * 800}, {"role": "assistant", "content": "y" * 400}])
    assert est.user_head_chars == len("Instructions: " + "be brief. " * 50 + "{literal}\nDocument: ")
    rows = [Document(f"r{i}", "a short document", None, {}) for i in range(10)]
    s = summarize_plan(rows, est, block_tokens=16)
    shared = est.system_prefix_tokens(None) // 16 * 16
    assert shared > 400 and s.groups[0].cacheable_tokens == 9 * shared
    assert 0.8 < s.prefix_share < 0.9 and not s.tokens_exact


def test_prompt_builder_matches_the_models_chat_template(model_dir):
    from transformers import PreTrainedTokenizerFast  # AutoTokenizer's class for this folder derives from it

    hf = PreTrainedTokenizerFast.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there"}]
    b = PromptBuilder(model_dir)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert b.render("Be terse.", "Hello there") == expected
    assert b.encode(expected) == hf(expected, add_special_tokens=False)["input_ids"]


def test_fast_prompt_ids_equal_full_encoding(model_dir):
    b = PromptBuilder(model_dir, "Source: {source}\n\n{text}")
    system = "You extract fields.\nRules: be exact. " * 20
    users = ["plain text", " leading space", "\nleading newline", "ünïcödé — dashes", "<|im_end|> inside", ""]
    for user in users:
        for sys_prompt in (system, None, "x"):
            assert b.prompt_ids(sys_prompt, user) == b.encode(b.render(sys_prompt, user)), (sys_prompt, user)
        assert b.prompt_ids_batch(sys_prompt, users) == [b.encode(b.render(sys_prompt, u)) for u in users]


def reference_bound(prompts, bs):
    """The rule without any memory limit: every block of every prompt remembered."""
    seen, total = set(), 0
    for ids in prompts:
        h, hit, matching = 0, 0, True
        for start in range(0, len(ids) - bs + 1, bs):
            h = hash((h, tuple(ids[start:start + bs])))
            if matching and h in seen and start + bs <= len(ids) - 1:
                hit += bs
            else:
                matching = False
                seen.add(h)
        total += hit
    return total


def test_bounded_bound_equals_the_unbounded_rule_with_shared_preambles():
    """Heads (system prompts) that share a long preamble, in interleaved order, bodies of their own."""
    import random

    rng = random.Random(3)
    preamble = [rng.randrange(1000) for _ in range(90)]
    heads = {k: preamble + [rng.randrange(1000) for _ in range(rng.randrange(10, 60))] for k in "abcd"}
    prompts, keyed = [], []
    for _ in range(400):
        k = rng.choice("abcd")
        ids = heads[k] + [rng.randrange(1000, 9000) for _ in range(rng.randrange(5, 70))]
        prompts.append(ids)
        keyed.append((ids, (k, len(heads[k]))))
    for bs in (4, 16):
        b = PrefixCacheBound(block_tokens=bs)
        assert sum(b.add(ids, head) for ids, head in keyed) == reference_bound(prompts, bs)
        small = PrefixCacheBound(block_tokens=bs, max_blocks=50)  # forgetting: never above the rule
        assert 0 < sum(small.add(ids, head) for ids, head in keyed) <= reference_bound(prompts, bs)
        assert len(b._seen) < sum(len(p) for p in prompts) // bs // 4  # not every block of every row


def test_plan_escapes_control_characters_of_a_system_prompt(make_job, tmp_path):
    """A system prompt from the input with an escape sequence (a terminal title) and a `\\r` went to
    the terminal as they were: `plan` printed what the data held."""
    import json

    from click.testing import CliRunner

    from runner.cli import cli

    docs = tmp_path / "data" / "docs.jsonl"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(json.dumps({"id": "a", "text": "t", "system_prompt": "x \x1b]0;pwned\x07 \r OVERWRITTEN"}) + "\n")
    out = CliRunner().invoke(cli, ["plan", str(make_job(docs=docs))])
    assert out.exit_code == 0, out.output
    assert "\x1b" not in out.output and "\x07" not in out.output and "\r" not in out.output
    assert "\\x1b]0;pwned\\x07" in out.output
