"""The batch-independence probe and layer layouts: per-example clipping is exact only if
each example's outputs depend on that example alone and the engine reads every layer's
examples on the right dimension.

Batch-mixing operations (``x - x.mean(0)``, ``F.batch_norm``) were accepted and one
example moved the clipped sum by far more than C; sequence-first activations (PyTorch's
default ``nn.TransformerEncoderLayer``, an LSTM's time-major output feeding a Linear) were
clipped per position. Each case is now exact (compared with a loop of batch-size-1
backward passes) or refused before the first step with the option that fixes it."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.probe import BatchDependenceError  # noqa: E402

T, E = 5, 8


def _seqs(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, T, E, generator=g), torch.randint(0, 3, (n,),
                                                                           generator=g))


def _first_step(model, ds, batch_size=8, **kw):
    kw.setdefault("noise_multiplier", 1.0)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=batch_size), seed=0, **kw)
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    return p, x, y


class _Centered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        x = x.mean(1)
        return self.lin(x - x.mean(0))


class _FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        return self.lin(nn.functional.batch_norm(x.mean(1), None, None, training=True))


class _MixedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        out = self.lin(x.mean(1))
        return out - out.mean(0)


@pytest.mark.parametrize("cls", [_Centered, _FunctionalBatchNorm, _MixedOutput])
def test_batch_mixing_is_refused_before_the_first_step(cls):
    """One record of a batch-centred model moves the clipped sum by far more than C (the
    bound per-example clipping promises): ``x - x.mean(0)`` gave 1.99 -> 1053 per step."""
    model = cls()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _first_step(model, _seqs())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _Encoder(nn.Module):
    """PyTorch's default (sequence-first) transformer layer on batch-first data."""

    def __init__(self, batch_first=False):
        super().__init__()
        self.batch_first = batch_first
        self.enc = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)  # (T, B, E)
        h = self.enc(x)
        return self.head(h.mean(1 if self.batch_first else 0))


class _LSTMHead(nn.Module):
    """A time-major LSTM whose output feeds a Linear (the Linear sees (T, B, H))."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(E, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(x.transpose(0, 1))
        return self.fc(out).mean(0)


@pytest.mark.parametrize("make,kw", [
    (lambda: _Encoder(batch_first=False), {}),
    (lambda: _Encoder(batch_first=True), {}),
    (_LSTMHead, {"batch_dims": {"fc": 1}}),
], ids=["encoder-seq-first", "encoder-batch-first", "lstm-linear-declared"])
@pytest.mark.parametrize("batch", [8, T])  # B == T: a position-wise clip would pass unseen
def test_sequence_first_layers_are_clipped_per_example(make, kw, batch, oracle):
    """Equal to the loop of batch-size-1 passes (float64); before, norms were 6-100% off
    and with B == T positions were clipped instead of examples."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        C = 0.02
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                         DataLoader(_seqs(n=40), batch_size=batch), noise_multiplier=0.0,
                         max_grad_norm=C, sampling="fixed", seed=1, **kw)
        x, y = next(iter(p.data_loader))
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, C, 0.5, batch)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("batch", [8, T])
def test_undeclared_sequence_first_layer_is_refused_with_the_option_to_pass(batch):
    """With B != T the layer's rows do not match the batch; with B == T they do, and the
    probe finds the batch on dimension 1. Either way: refused, naming the option."""
    model = _LSTMHead()
    with pytest.raises(ValueError, match=r"fc.*\(Linear\).*batch_dims=\{'fc': 1\}"):
        _first_step(model, _seqs(), batch_size=batch, sampling="fixed")


def test_expansion_of_broadcast_inputs_never_applies_to_a_time_major_input():
    """At T = 1 a sequence-first input is (1, B, E): expanding its leading dimension to B
    (as broadcast position ids are) would change the forward output. A declared
    sequence-first layer is never expanded, and its forward is unchanged."""
    torch.manual_seed(0)
    model = _LSTMHead()
    x = torch.randn(6, 1, E)
    with torch.no_grad():
        want = model(x)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(torch.randn(12, 1, E), torch.zeros(12).long()),
                                batch_size=6),
                     noise_multiplier=1.0, batch_dims={"fc": 1})
    out = p.model(x)
    torch.testing.assert_close(out, want)


def test_batch_dims_are_checked():
    model = _LSTMHead()
    loader = DataLoader(_seqs(), batch_size=8)
    with pytest.raises(ValueError, match="not trainable layers of the model"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0, batch_dims={"head": 1})
    with pytest.raises(ValueError, match="must be 0 .batch-first. or 1"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0, batch_dims={"fc": 2})
    with pytest.raises(ValueError, match="contradicts the layer itself"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     noise_multiplier=1.0, batch_dims={"rnn": 0})


def test_probe_runs_once_and_restores_buffers_and_random_state():
    """Extra forward passes on the first step only: three, and two more since the
    forward writes a buffer (the batch collapsed to its first and to its last example);
    buffers and the global random state are as they were (a resumed run stays
    bit-identical), and so is a plain attribute the forward sets (a call counter)."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(E, 3)
            self.drop = nn.Dropout(0.3)
            self.register_buffer("seen", torch.zeros(()))
            self.calls = 0
            self.passes = []  # every forward, the probe's too (no plain attribute)

        def forward(self, x):
            self.calls += 1
            self.passes.append(1)
            self.seen += 1
            return self.lin(self.drop(x.mean(1)))

    model = Counting()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_seqs(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")
    for k, (x, y) in enumerate(p.data_loader):
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        state = torch.get_rng_state()
        p.optimizer.step()
        assert torch.equal(state, torch.get_rng_state())
        if k == 2:
            break
    assert len(model.passes) == 3 + 3 + 2 and model.seen.item() == 3 and model.calls == 3


def test_probe_can_be_switched_off_by_the_user_who_promises_independence():
    p, _, _ = _first_step(_Centered(), _seqs(), check_batch_independence=False)
    assert p.accountant.steps == 1


class _Reaching(nn.Module):
    """Mixing that the first example never reaches: only replacing another row shows it
    (before, the probe replaced example 0 alone and these passed)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        h = x.mean(1)
        if self.how == "others-mean":
            h = h - h[1:].mean(0)
        elif self.how == "reverse-cumsum":
            h = h.flip(0).cumsum(0).flip(0)
        else:  # the last example added to every example
            h = h + h[-1]
        return self.lin(h)


@pytest.mark.parametrize("how", ["others-mean", "reverse-cumsum", "last-row"])
@pytest.mark.parametrize("batch", [4, 16])
def test_mixing_from_the_last_example_is_refused(how, batch):
    # fixed-size batches: a Poisson batch of one example has no other example to mix
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _first_step(_Reaching(how), _seqs(), batch_size=batch, sampling="fixed")


class _Sizes(nn.Module):
    def __init__(self, hidden=E):
        super().__init__()
        self.lin = nn.Linear(E, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 3)
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.head(self.norm(self.lin(x.mean(1))))


def _rearmed_smaller_batch(model, ds):
    """Poisson batches of expected size 32: the steps until one smaller than the largest
    before it and larger than the smallest (a new smallest is probed whole), whose
    forward runs with a forward hook added (which re-arms the probe). Returns that
    batch's size and the rows of the forwards of its step."""
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=32), noise_multiplier=1.0, seed=0)
    largest, least = 0, None
    for x, y in (b for _ in range(20) for b in p.data_loader):
        smaller = least is not None and least < len(x) < largest
        largest = max(largest, len(x))
        least = len(x) if least is None or 2 <= len(x) < least else least
        handle = p.model.norm.register_forward_hook(lambda *a: None) if smaller else None
        first = len(model.rows)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if handle is not None:
            handle.remove()
            return len(x), model.rows[first:]
    raise AssertionError("no batch smaller than an earlier one")


def test_probe_runs_on_the_whole_batch_first_and_on_seven_examples_of_a_smaller_one():
    """The first probe runs on the whole batch; a re-armed probe of a batch smaller than
    one probed whole, three passes over 7 rows: its cost stays a fraction of a step
    however large the batch; a hidden size of 7 is not taken for the batch."""
    model = _Sizes(hidden=7)
    _first_step(model, _seqs(64), batch_size=32, sampling="fixed")
    assert model.rows == [32, 32, 32, 32]
    model = _Sizes(hidden=7)
    size, rows = _rearmed_smaller_batch(model, _seqs(64))
    assert rows == [size, 7, 7, 7]


def test_probe_avoids_a_sub_batch_that_is_another_input_dimension():
    """T = 7: the probe's rows must not have the size of the inputs' sequence dimension."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 7, E, generator=g), torch.randint(0, 3, (64,),
                                                                         generator=g))
    size, rows = _rearmed_smaller_batch(_Sizes(), ds)
    assert rows == [size, 5, 5, 5]


class _MixesLargeBatches(nn.Module):
    """Centres its hidden layer over the batch only from ``threshold`` examples on: at
    the few examples of a sub-batch it is per example, at the batches trained on not."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold
        self.a, self.b = nn.Linear(E, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x.mean(1))
        if h.shape[0] >= self.threshold:
            h = h - h.mean(0)
        return self.b(torch.relu(h))


@pytest.mark.parametrize(("sampling", "batch"), [("fixed", 16), ("poisson", 10)])
def test_a_forward_that_mixes_only_large_batches_is_refused(sampling, batch):
    """The probe ran on seven examples of the batch, at which this model keeps examples
    apart, so it trained every batch of 12 or more with their mean subtracted (each
    example moving every other's gradient) unrefused. The first probe now runs on the
    whole batch (fixed batches of 16: refused at the first step), and a batch larger than
    any before re-arms it (Poisson batches of expected size 10: sizes 7 and 5 first with
    this seed, then 16, refused before its step)."""
    model = _MixesLargeBatches(12)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_seqs(200), batch_size=batch), noise_multiplier=1.0, seed=0,
                     sampling=sampling)
    sizes = []
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        for x, y in p.data_loader:
            sizes.append(len(x))
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
    assert sizes[0] < 12 <= sizes[-1] if sampling == "poisson" else sizes == [16]
    assert p.accountant.steps == len(sizes) - 1


class _WholeBatchOnly(nn.Module):
    """A model that only runs on the batch size it was built for, and mixes examples."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        h = x.mean(1).reshape(self.batch, E)
        return self.lin(h - h.mean(0))


def test_a_model_that_needs_the_whole_batch_is_probed_on_it():
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _first_step(_WholeBatchOnly(16), _seqs(), batch_size=16, sampling="fixed")


# ------------------------------------------------------------------ re-arming


class _EvalNorm(nn.Module):
    """A normalisation written with ``F.batch_norm(training=self.training)``: per example
    in eval mode (running statistics), batch statistics in training mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(E))
        self.register_buffer("running_var", torch.ones(E))

    def forward(self, x):
        return nn.functional.batch_norm(x, self.running_mean, self.running_var,
                                        training=self.training)


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(E, E)
        self.norm = _EvalNorm()
        self.lin2 = nn.Linear(E, 3)

    def forward(self, x):
        return self.lin2(self.norm(self.lin1(x.mean(1))))


class _BatchCentre(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def _toggle_modes(model):
    model.eval()  # evaluate() ...
    with torch.no_grad():
        model(torch.randn(4, T, E))
    model.train()  # ... and back: the normalisation is now in training mode too


def _hook_on_norm(model):
    model.norm.register_forward_hook(lambda m, a, out: out - out.mean(0))


def _swap_norm(model):
    model.norm = _BatchCentre()


class _CentringNorm(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def _swap_class_of_norm(model):
    model.norm.__class__ = _CentringNorm  # same module object, a forward that mixes


@pytest.mark.parametrize("change", [_toggle_modes, _hook_on_norm, _swap_norm,
                                    _swap_class_of_norm],
                         ids=["eval-train-toggle", "forward-hook", "submodule-swapped",
                              "class-swapped"])
def test_the_probe_re_arms_on_changes_that_mix_examples(change):
    """Mixing switched on after the first step (the usual ``model.eval(); evaluate();
    model.train()`` puts a module kept in eval mode into training mode; a hook or a
    module added) is refused at the next step. Before, only a change of the trainable set
    re-armed the probe, and one example moved the clipped sum by 1.55 C at step 3."""
    model = _Normed()
    model.norm.eval()  # per example while it stays in eval mode
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_seqs(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")
    it = iter(p.data_loader)
    for _ in range(2):
        x, y = next(it)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    change(model)
    x, y = next(it)
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        p.optimizer.step()
    assert p.accountant.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_mode_toggle_back_to_the_same_modes_does_not_re_probe():
    """``model.eval(); model.train()`` on a model whose modules were all in training mode
    changes nothing: no extra forward passes after the first step's probe."""
    calls = []
    model = _Normed()
    model.lin2.register_forward_pre_hook(lambda m, a: calls.append(1))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_seqs(), batch_size=8), noise_multiplier=1.0, seed=0,
                     sampling="fixed")
    model.norm.eval()
    for k, (x, y) in enumerate(p.data_loader):
        if k == 1:
            model.eval()
            model.train()
            model.norm.eval()  # the modes of the first step again
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        if k == 2:
            break
    assert len(calls) == 3 + 3  # three steps, three probe passes once


class _RunningMean(nn.Module):
    """A running mean of the inputs kept in a buffer, updated in training mode (in place,
    or by assigning a new tensor to the buffer's name)."""

    def __init__(self, assign: bool):
        super().__init__()
        self.lin = nn.Linear(E, 3)
        self.assign = assign
        self.register_buffer("running", torch.zeros(E))

    def forward(self, x):
        h = x.mean(1)
        out = self.lin(h - self.running)  # each example on its own: no mixing in the step
        if self.training:
            new = 0.9 * self.running + 0.1 * h.detach().mean(0)
            if self.assign:
                self.running = new
            else:
                self.running.copy_(new)
        return out


@pytest.mark.parametrize("assign", [False, True], ids=["in_place", "assigned"])
def test_a_buffer_written_from_the_batch_is_refused_before_the_first_step(assign):
    """Every output row depends on its own example alone, but the buffer holds a mean of
    the training inputs with no noise, released with the model's state_dict: refused,
    naming the buffer, before anything is released; the refusal puts the buffer back at
    its value before the step's forward (also when the forward assigns a new tensor), so
    a state_dict saved after catching it holds no mean of the refused batch."""
    model = _RunningMean(assign)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_seqs(), batch_size=8), noise_multiplier=1.0, seed=0)
    x, y = next(iter(p.data_loader))
    before = [q.detach().clone() for q in model.parameters()]
    before_forward = model.running.clone()
    nn.functional.cross_entropy(p.model(x), y).backward()
    assert not torch.equal(model.running, before_forward)  # the forward wrote it
    with pytest.raises(BatchDependenceError, match="buffer 'running'.*state_dict"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    torch.testing.assert_close(model.state_dict()["running"], before_forward, rtol=0, atol=0)


def test_a_running_extreme_written_from_the_batch_is_refused():
    """A quantization observer keeps the per-feature minimum and maximum of the training
    inputs in buffers (released with the state_dict, no noise). The step's own forward
    had already moved them to the batch's extremes, so the probe's passes over a part of
    that batch, started from there, left them unchanged and the run trained. The passes
    now start from the buffers as they were before the step's forward: refused."""
    from torch.ao.quantization import PerChannelMinMaxObserver

    n = 16  # example i alone holds feature i's maximum
    x = torch.diag(torch.arange(1.0, n + 1))
    ds = TensorDataset(x, torch.arange(n) % 3)
    torch.manual_seed(0)
    model = nn.Sequential(PerChannelMinMaxObserver(ch_axis=1), nn.Linear(n, 3))
    with pytest.raises(BatchDependenceError, match="buffer '0.max_val'.*state_dict"):
        _first_step(model, ds)


class _ActNorm(nn.Module):
    """Glow's ActNorm (Kingma & Dhariwal 2018): its shift and log-scale initialised from
    the first batch's mean and standard deviation, a buffer flag set once done."""

    def __init__(self, d):
        super().__init__()
        self.loc, self.logs = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if self.initialized.item() == 0:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-torch.log(x.std(0) + 1e-6))
                self.initialized.fill_(1)
        return (x + self.loc) * torch.exp(self.logs)


def test_a_layer_initialised_from_the_first_batch_is_refused():
    """Data-dependent initialisation sets parameters to the first batch's exact mean, no
    noise: the step's forward had already set the flag, so the probe's passes (started
    from there) saw no mixing and the run trained with the mean in ``loc``. They now
    start from the buffers before that forward, initialise on their own rows, and the
    mixing shows."""
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    model = nn.Sequential(_ActNorm(6), nn.Linear(6, 3))
    with pytest.raises(BatchDependenceError, match=r"mixed.*layer 0 \(_ActNorm\)"):
        _first_step(model, ds)


def test_a_buffer_the_data_does_not_reach_trains():
    """A step counter (the same whatever the examples hold) and a constant buffer read
    in the forward pass are no release of the data: the run trains."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(E, 3)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
            self.register_buffer("scale", torch.full((E,), 2.0))

        def forward(self, x):
            self.steps += 1
            return self.lin(x.mean(1) * self.scale)

    model = Counted()
    p, _, _ = _first_step(model, _seqs())
    assert p.accountant.steps == 1 and model.steps.item() == 1


class _SequenceFirst(nn.Module):
    """Opacus's text test model: token ids ``(T, B)`` (its collate_fn transposes the
    batch), Embedding and attention sequence-first, then batch-first logits."""

    def __init__(self):
        super().__init__()
        self.emb, self.attn = nn.Embedding(20, 8), nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.fc(h.mean(0))


def test_a_sequence_first_batch_from_the_collate_fn_is_named():
    """A collate_fn that puts the batch on dimension 1 is refused by make_private (the
    loader cuts batches on dimension 0); a loop that transposes the batch itself before
    the model is refused at its step: the message says where the batch is and what to
    change (a batch-first input, the transpose in forward), not only that no input has it
    first."""
    def transpose(rows):
        ids, labels = torch.utils.data.default_collate(rows)
        return ids.t(), labels

    ds = TensorDataset(torch.randint(0, 20, (40, 6)), torch.randint(0, 3, (40,)))
    model = _SequenceFirst()
    settings = dict(noise_multiplier=1.0, sampling="fixed", seed=0,
                    batch_dims={"emb": 1, "attn": 1})
    with pytest.raises(BatchDependenceError, match=r"dimension 1 of batch\[0\].*transpose"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8, collate_fn=transpose), **settings)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), **settings)
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x.t()), y).backward()
    with pytest.raises(BatchDependenceError, match=r"on dimension 1 of input 0 \(shape \(6, 8\)\)"
                       r".*collate_fn.*transpose"):
        p.optimizer.step()
    assert p.accountant.steps == 0


class _Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, 3)

    def forward(self, x):
        return self.lin(x.mean(1))


@pytest.mark.parametrize("make, mixes", [(_Pooled, False), (_Centered, True)])
def test_a_forward_on_a_few_examples_before_training_is_not_what_the_probe_runs_on(
        make, mixes):
    """A shape check in training mode before the loop (``print(model(x[:2]).shape)``):
    the probe runs on the forward of the step's batch, so an independent model trains and
    a mixing one is still refused (the probe ran on the stray forward's inputs and refused
    every model: none of them held the step's batch)."""
    torch.manual_seed(0)
    model = make()
    ds = _seqs()
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=8), noise_multiplier=1.0, seed=0)
    model(ds.tensors[0][:2])
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    if mixes:
        with pytest.raises(BatchDependenceError, match="lin"):
            p.optimizer.step()
        assert p.accountant.steps == 0
    else:
        p.optimizer.step()
        assert p.accountant.steps == 1


class _Positions(nn.Module):
    """A position table looked up as ``emb(torch.arange(T))`` (nanoGPT's ``wpe(pos)``): no
    batch dimension, unless ``batched`` gives it a leading one (``pos[None]``)."""

    def __init__(self, batched):
        super().__init__()
        self.pos, self.lin, self.batched = nn.Embedding(T, E), nn.Linear(E, 3), batched

    def forward(self, x):
        pos = torch.arange(T)
        return self.lin(x + self.pos(pos[None] if self.batched else pos)).mean(1)


def test_a_layer_without_a_batch_dimension_is_refused_when_its_rows_match_the_batch(oracle):
    """A batch of exactly T examples (fixed-size batches of T): the table's T rows were
    read as the T examples and clipped one by one, although each row's gradient sums every
    example's (the step's count of rows per layer refuses it only when the sizes differ).
    With the table given a leading batch dimension (``pos[None]``) the step is the naive
    one."""
    torch.set_default_dtype(torch.float64)
    try:
        for batched in (False, True):
            torch.manual_seed(0)
            model = _Positions(batched)
            ref = copy.deepcopy(model)
            ds = TensorDataset(torch.randn(40, T, E), torch.randint(0, 3, (40,)))
            p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                             DataLoader(ds, batch_size=T), noise_multiplier=0.0,
                             max_grad_norm=0.1, sampling="fixed", seed=0)
            x, y = next(iter(p.data_loader))
            nn.functional.cross_entropy(model(x), y).backward()
            if not batched:
                with pytest.raises(BatchDependenceError, match="does not receive the batch"):
                    p.optimizer.step()
                assert p.accountant.steps == 0
                continue
            p.optimizer.step()
            oracle.step(ref, x, y, 0.1, 0.5, T)
            for a, b in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


class _Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="mean", dtype=torch.float64)
        self.out = nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, ids, offsets):
        return self.out(self.bag(ids, offsets))


def _flatten_bags(batch):
    """A collate_fn joining the examples' bags into EmbeddingBag's 1-D ids with offsets."""
    ids = [b for b, _ in batch]
    offsets = torch.tensor([0] + [len(b) for b in ids[:-1]]).cumsum(0)
    return torch.cat(ids), offsets, torch.stack([y for _, y in batch])


@pytest.mark.parametrize("check", [True, False])
def test_flattened_embedding_bag_batch(check, oracle):
    """EmbeddingBag's 1-D ids with offsets: the offsets have the batch's size, but they
    are positions in the flattened ids, so the probe's batch with one example's offset
    replaced by another's is no batch the model can run (torch's RuntimeError came out of
    step()). Refused with a BatchDependenceError saying why and what to pass instead,
    nothing released; with ``check_batch_independence=False`` the step is the naive
    one (the EmbeddingBag rule reads the bags from the offsets)."""
    g = torch.Generator().manual_seed(0)
    ds = [(torch.randint(0, 10, (int(torch.randint(1, 5, (), generator=g)),), generator=g),
           torch.randint(0, 3, (), generator=g)) for _ in range(16)]
    torch.manual_seed(0)
    model = _Bags()
    ref = copy.deepcopy(model)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(ds, batch_size=8, collate_fn=_flatten_bags),
                     noise_multiplier=0.0, max_grad_norm=0.05, sampling="fixed", seed=0,
                     check_batch_independence=check)
    ids, offsets, y = next(iter(p.data_loader))
    nn.functional.cross_entropy(p.model(ids, offsets), y).backward()
    if check:
        with pytest.raises(BatchDependenceError, match="not one row per example"):
            p.optimizer.step()
        assert p.accountant.steps == 0
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
        return
    p.optimizer.step()
    ends = torch.cat([offsets[1:], torch.tensor([len(ids)])])
    rows = oracle.grads(lambda i: nn.functional.cross_entropy(
        ref(ids[offsets[i]:ends[i]], torch.tensor([0])), y[i:i + 1]), len(y),
        oracle.trainable(ref))
    total, _ = oracle.clip_and_sum(rows, 0.05)
    oracle.sgd_step(oracle.trainable(ref), total, 0.5, 8)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [_Centered, _FunctionalBatchNorm, _MixedOutput])
def test_a_tracker_used_alone_probes_before_its_first_clipped_sum(cls):
    """GradSampleTracker on its own (no make_private, no optimizer step) runs the same
    probe before its first clipped sum: a model mixing examples is refused, nothing is
    returned and the records are cleared. Switched off (check_independence=False), the
    same sum is returned and adding one outlier moves it by more than the clip bound,
    which is what the probe prevents."""
    from privlearn.torch import GradSampleTracker

    x, y = _seqs(n=6).tensors
    model = cls()
    tracker = GradSampleTracker(model, loss_reduction="sum")
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(BatchDependenceError, match="mixed|combines examples"):
        tracker.clipped_sum(0.1)
    assert not tracker.has_gradients()
    tracker.detach()

    def unprobed(xs, ys):
        m = copy.deepcopy(model)
        t = GradSampleTracker(m, loss_reduction="sum", check_independence=False)
        nn.functional.cross_entropy(m(xs), ys, reduction="sum").backward()
        sums, _, _ = t.clipped_sum(0.1)
        t.detach()
        return torch.cat([sums[id(q)].flatten() for q in m.parameters()])

    xo = torch.cat([50.0 * torch.randn_like(x[:1]), x])  # an outlier added
    yo = torch.cat([y[:1], y])
    assert (unprobed(xo, yo) - unprobed(x, y)).norm() > 0.1  # add/remove sensitivity C


def test_a_tracker_used_alone_on_an_independent_model_probes_once():
    """An independent model passes the tracker's probe and its clipped sum is the one
    without the probe; the probe is not run again on the next batch."""
    from privlearn.torch import GradSampleTracker

    x, y = _seqs(n=6).tensors
    model = nn.Sequential(nn.Flatten(), nn.Linear(T * E, 3))
    ref = copy.deepcopy(model)
    sums = []
    for m, check in ((model, True), (ref, False)):
        t = GradSampleTracker(m, loss_reduction="sum", check_independence=check)
        nn.functional.cross_entropy(m(x), y, reduction="sum").backward()
        s, _, _ = t.clipped_sum(0.5)
        sums.append(torch.cat([s[id(q)].flatten() for q in m.parameters()]))
        if check:
            assert not t._probe_pending
            nn.functional.cross_entropy(m(x[:3]), y[:3], reduction="sum").backward()
            t.clipped_sum(0.5)
            assert not t._probe_pending
        t.detach()
    torch.testing.assert_close(sums[0], sums[1])


def test_a_tracker_used_alone_refuses_a_parameter_used_outside_its_layers():
    """A tied output head written functionally (h @ emb.weight.T): the tracker on its own
    returned a clipped sum without that use's part of the gradient (off from the loop
    of batch-size-1 passes by more than the gradient itself), where make_private's step
    refuses it. Now its clipped_sum refuses it too, and clears the records."""
    from privlearn.errors import TrainingLoopError
    from privlearn.torch import GradSampleTracker

    class TiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)

        def forward(self, ids):
            return torch.tanh(self.lin(self.emb(ids))) @ self.emb.weight.T

    torch.manual_seed(0)
    model = TiedHead()
    ids = torch.randint(0, 10, (6, 5))
    tracker = GradSampleTracker(model, loss_reduction="sum", check_independence=False)
    (model(ids) ** 2).sum().backward()
    with pytest.raises(TrainingLoopError, match=r"\['emb.weight'\] are used outside"):
        tracker.clipped_sum(1.0)
    assert not tracker.has_gradients()
    tracker.detach()
