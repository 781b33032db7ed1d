"""Loop orders and models users write: ``out = model(x); optimizer.zero_grad(); loss.backward()``
trained on noise alone (zero_grad dropped the forward's records) and a model left in
eval mode recorded nothing; both ran every step, charged, with every check skipped."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import TrainingLoopError  # noqa: E402
from privlearn.torch import BatchDependenceError, make_private  # noqa: E402


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _run(order, model=None, steps=3, **kw):
    torch.manual_seed(1)
    model = model or nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=16), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0, sampling="fixed", **kw)
    for k, (x, y) in enumerate(p.data_loader):
        if order == "zero_grad first":
            p.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(p.model(x), y)
        else:
            loss = nn.functional.cross_entropy(p.model(x), y)
            p.optimizer.zero_grad()
        loss.backward()
        p.optimizer.step()
        if k + 1 == steps:
            break
    return p, model


def test_zero_grad_between_forward_and_backward_trains_on_the_batch():
    """Same seeds: the two orders give bit-identical parameters (before, the second
    order's update was the noise alone)."""
    _, a = _run("zero_grad first")
    _, b = _run("zero_grad after forward")
    for u, v in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(u, v)


def test_zero_grad_after_forward_still_probes_batch_independence():
    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(10, 16), nn.Linear(16, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h - h.mean(0))

    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        _run("zero_grad after forward", Centred())


def test_zero_grad_after_backward_is_refused_with_its_cause(oracle):
    """``loss.backward(); optimizer.zero_grad(); optimizer.step()`` discards the per-example
    gradients backward recorded: the step is refused naming that order (it was refused as
    if the forward pass had run under no_grad or on another model), nothing is changed or
    charged, and the next batches of the same pass train as the naive loop does (the next
    one was refused as two batches drawn for one step)."""
    x_all, y_all = _data().tensors
    torch.manual_seed(0)
    model = nn.Linear(10, 2).double()
    ref = copy.deepcopy(model)
    C, lr = 0.1, 0.5
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                     DataLoader(TensorDataset(x_all.double(), y_all), batch_size=16),
                     noise_multiplier=0.0, max_grad_norm=C, seed=0, sampling="fixed")
    it = iter(p.data_loader)
    x, y = next(it)
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.zero_grad()
    with pytest.raises(TrainingLoopError, match=r"zero_grad\(\) was called after "
                       r"loss\.backward\(\) and before optimizer\.step\(\)(.|\n)*before the "
                       r"forward pass or after step\(\)"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    assert all(torch.equal(u, v) for u, v in zip(ref.parameters(), model.parameters(),
                                                 strict=True))
    for _ in range(2):  # the usual order on the next batches of the same pass
        x, y = next(it)
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        oracle.step(ref, x, y, C, lr, 16)
    assert p.accountant.steps == 2
    for u, v in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("refused_chunk", [0, 1])
def test_a_virtual_batch_refused_at_a_chunk_releases_none_of_its_chunks(refused_chunk):
    """With virtual batches, a chunk refused for that order drops its whole logical batch:
    the chunks after it used to be released alone as one step (a part of the batch chosen
    by position, not the sampler's law), and one record could move it by more than C."""
    n = 24
    model = nn.Linear(n, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(torch.eye(n, dtype=torch.float64),
                                              torch.zeros(n)), batch_size=12),
                     noise_multiplier=0.0, max_grad_norm=100.0, seed=0, sampling="fixed",
                     max_physical_batch_size=4, loss_reduction="sum")
    released, before = [], model.weight.detach().clone()
    for k, (x, _) in enumerate(p.data_loader):  # logical batches of 12: chunks of 4
        p.model(x).sum().backward()
        if k == refused_chunk:
            p.optimizer.zero_grad()
            with pytest.raises(TrainingLoopError, match="zero_grad"):
                p.optimizer.step()
            continue
        p.optimizer.step()
        p.optimizer.zero_grad()
        after = model.weight.detach().clone()
        if not torch.equal(after, before):  # an update: which examples it holds
            released.append(set((after - before).ne(0).nonzero()[:, 1].tolist()))
        before = after
        if k == 5:
            break
    # the first logical batch (chunks 0-2) released nothing; the second one all 12 rows
    assert p.accountant.steps == 1
    assert [len(r) for r in released] == [12]


def test_a_model_left_in_eval_mode_is_refused_not_charged():
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=16), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0, sampling="fixed")
    p.model.eval()
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"eval mode.*p\.model\.train\(\)"):
        p.optimizer.step()
    assert p.accountant.steps == 0
    p.model.train()  # the documented fix: the next batch trains
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    p.optimizer.step()
    assert p.accountant.steps == 1


def test_an_empty_poisson_batch_still_takes_its_noisy_step():
    """No examples, nothing recorded: the step is the noise alone, as accounted."""
    model = nn.Linear(10, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=1), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0)  # rate 1/64: about a third are empty
    steps = empty = 0
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        if len(y):
            nn.functional.cross_entropy(p.model(x), y).backward()
        else:
            empty += 1
        p.optimizer.step()
        steps += 1
    assert empty > 0 and p.accountant.steps == steps


class _SeqModel(nn.Module):
    """Token ids -> Embedding -> LayerNorm -> Linear on (B, T, D) -> Conv1d -> mean."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 6)
        self.conv = nn.Conv1d(6, 3, 2)

    def forward(self, ids):
        h = torch.tanh(self.lin(self.norm(self.emb(ids))))
        return self.conv(h.transpose(1, 2)).mean(2)


def test_empty_poisson_batches_after_the_first_step_take_the_noise_only_step(oracle):
    """After the first step, rules are evaluated during backward; on an empty batch a
    layer with a sequence dimension (Linear on (0, T, D), Conv, LayerNorm) failed to
    reshape its zero rows and training stopped. Every step now equals the definition:
    with noise 0, an empty batch leaves the parameters as they are and every other step
    is the naive loop's clipped step."""
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randint(0, 12, (8, 5), generator=g),
                           torch.randint(0, 3, (8,), generator=g))
        model = _SeqModel()
        ref = copy.deepcopy(model)
        C, lr = 0.1, 0.5
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=lr),
                         DataLoader(ds, batch_size=1), noise_multiplier=0.0,
                         max_grad_norm=C, seed=3)  # rate 1/8: a third of batches empty
        empty_after_first = 0
        for _ in range(3):
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                oracle.step(ref, x, y, C, lr, 1.0)
                empty_after_first += len(x) == 0 and p.accountant.steps > 1
        assert empty_after_first > 0 and p.accountant.steps == 24
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_rows_fed_in_place_of_an_empty_batch_are_named_not_a_division_by_zero():
    """A loop that feeds the model other rows when the batch is empty: refused with the
    cause (it was a ZeroDivisionError while building the message)."""
    model = nn.Linear(10, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=1), noise_multiplier=0.5, seed=0)
    stand_in = _data().tensors
    with pytest.raises(BatchDependenceError, match=r"delivered 0 examples.*\(empty\) batch"):
        for x, y in p.data_loader:
            if len(y) == 0:
                x, y = stand_in[0][:2], stand_in[1][:2]
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()


def test_a_discriminator_s_two_backward_passes_point_to_one_summed_backward():
    """The DCGAN loop of Opacus's example: ``errD_real.backward(); errD_fake.backward()``
    before one step is refused (row i of the fake batch would be clipped with example i),
    naming the fix; the same losses added and backpropagated once train."""
    bce = nn.BCEWithLogitsLoss()
    for summed in (False, True):
        torch.manual_seed(0)
        disc = nn.Sequential(nn.Linear(10, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        p = make_private(disc, torch.optim.Adam(disc.parameters(), lr=1e-3),
                         DataLoader(_data(), batch_size=16), noise_multiplier=1.0, seed=0)
        x, _ = next(iter(p.data_loader))
        fake = torch.randn(len(x), 10)
        real_loss = bce(p.model(x), torch.ones(len(x), 1))
        fake_loss = bce(p.model(fake), torch.zeros(len(x), 1))
        p.optimizer.zero_grad()
        if summed:
            (real_loss + fake_loss).backward()
            p.optimizer.step()
            assert p.accountant.steps == 1
        else:
            real_loss.backward()
            with pytest.raises(RuntimeError, match="add them and call backward"):
                fake_loss.backward()


class _FunctionalTied(nn.Module):
    """A tied output head written as a functional call on the embedding's weight."""

    def __init__(self, functional=True):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.functional = functional
        if not functional:
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        return nn.functional.linear(h, self.emb.weight) if self.functional else self.head(h)


def _lm_backward(model):
    """A private run of ``model`` on token sequences and one batch's forward and
    backward (no step)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (64, 5), generator=g)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(TensorDataset(ids), batch_size=16), noise_multiplier=0.0,
                     max_grad_norm=1e-3, seed=0, sampling="fixed")
    (xb,) = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    logits = p.model(xb)
    nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 20), xb[:, 1:].reshape(-1)).backward()
    return p


def _lm_step(model):
    p = _lm_backward(model)
    p.optimizer.step()
    return p


def test_a_parameter_used_outside_its_layer_is_refused():
    """``F.linear(h, self.emb.weight)``: that use's gradient was silently dropped (the
    per-example norm 2.48 instead of 2.52); now refused, naming the parameter."""
    model = _FunctionalTied()
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(RuntimeError, match=r"\['emb\.weight'\] are used outside their layers"):
        _lm_step(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_parameter_used_outside_its_layer_is_refused_by_clip_and_accumulate_too():
    """The two-step API (``clip_and_accumulate()`` then ``add_noise()``) dropped that use's
    gradient without a word; now refused as ``step()`` refuses it, nothing added."""
    model = _FunctionalTied()
    p = _lm_backward(model)
    with pytest.raises(RuntimeError, match=r"\['emb\.weight'\] are used outside their layers"):
        p.optimizer.clip_and_accumulate()
    assert p.accountant.steps == 0


def test_an_l2_penalty_in_the_loss_is_refused_with_weight_decay_as_the_way_out():
    """``loss + lam * sum(p.pow(2).sum())``: the penalty's gradient reaches every
    parameter outside its layer (not per example, not clipped): refused before anything
    is released, pointing to the optimizer's ``weight_decay``, which trains."""
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))

    def run(weight_decay, penalty):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                weight_decay=weight_decay),
                         DataLoader(ds, batch_size=8), noise_multiplier=1.0, seed=0)
        x, y = next(iter(p.data_loader))
        loss = nn.functional.cross_entropy(p.model(x), y)
        if penalty:
            loss = loss + 1e-4 * sum(q.pow(2).sum() for q in model.parameters())
        loss.backward()
        p.optimizer.step()
        return p

    with pytest.raises(RuntimeError, match="used outside their layers.*weight_decay"):
        run(0.0, penalty=True)
    assert run(1e-4, penalty=False).accountant.steps == 1


def test_the_same_tie_through_a_module_trains():
    p = _lm_step(_FunctionalTied(functional=False))
    assert p.accountant.steps == 1


def test_a_trainable_layer_in_eval_mode_is_refused():
    """One layer switched to eval mode inside a training model: its gradient was dropped
    without a word; now refused, naming the layer."""
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=16), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0, sampling="fixed")
    model[0].eval()
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    nn.functional.cross_entropy(p.model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"layer\(s\) \['0'\] ran in eval mode"):
        p.optimizer.step()
    assert p.accountant.steps == 0


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_batch_refused_for_a_non_finite_gradient_is_replaced_by_the_next(chunk):
    """A NaN in one example's loss is refused with NonFiniteInputError before anything
    is released, as the refusals of the checks before it are: the batch (with the rest
    of its logical batch when it is a physical chunk of one) is dropped, not charged, and
    the next batch of p.data_loader trains. It was left pending, so every later step of
    the pass was refused ("2 batches were drawn") and the loop could not go on."""
    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.errors import NonFiniteInputError

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                     DataLoader(_data(), batch_size=16), noise_multiplier=0.5,
                     max_grad_norm=1.0, seed=0, sampling="fixed",
                     max_physical_batch_size=chunk)
    refused, physical = [], 0
    for _ in range(2):  # two epochs of 4 logical batches
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(p.model(x), y, reduction="none")
            if physical == 1:  # the first logical batch's second chunk, or second batch
                loss = loss * torch.tensor([float("nan")] + [1.0] * (len(y) - 1))
            loss.mean().backward()
            try:
                p.optimizer.step()
            except NonFiniteInputError:
                refused.append(physical)
            physical += 1
    assert refused == [1]
    assert p.accountant.steps == 7 and p.data_loader.batch_sampler.consumed == 7
    ref = compose(subsample(Gaussian(0.5), rate=16 / 64, scheme="fixed"), steps=7)
    assert p.epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("sampling", ["balls_in_bins", "shuffled_epochs", "cyclic_poisson"])
def test_a_refused_batch_of_a_scheduled_sampling_keeps_every_step_on_its_part(sampling):
    """Under a sampling whose batch of step t comes from part t mod b, the refused
    batch's step is taken by the next one trained: the batches drawn after it in the
    same pass belong to the steps after it, so the pass ends there (with a warning) and
    the next pass continues the schedule. Every released step still trains on part
    ``step mod b`` (ground truth: the sampler's own layout). The next batches of the pass
    were trained one step early: an example of part 3 took part in released steps 2 and
    3, less than b apart, which the accounted participation rules out."""
    x = torch.arange(32, dtype=torch.float32)[:, None].repeat(1, 10)  # column 0: index
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 2))
    extra = {"cycle_length": 4} if sampling == "cyclic_poisson" else {}
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(x, (x[:, 1] > 15).long()), batch_size=8),
                     noise_multiplier=1.0, max_grad_norm=1.0, seed=0, sampling=sampling,
                     epochs=3, **extra)
    parts = [set(a.tolist()) for a in p.data_loader.batch_sampler.parts()]
    assert len(parts) == 4
    trained, k = [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for xb, yb in p.data_loader:
                p.model.train(k != 1)  # the second batch is refused (eval mode)
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(xb), yb).backward()
                try:
                    p.optimizer.step()
                    trained.append(set(xb[:, 0].long().tolist()))
                except TrainingLoopError:
                    pass
                k += 1
    p.model.train()
    assert len(trained) == p.accountant.steps >= 8
    for t, ids in enumerate(trained):
        assert ids <= parts[t % 4], f"step {t} trained outside part {t % 4}"
    assert any("the pass ends here" in str(w.message) for w in caught)


def test_a_step_refused_while_clipping_draws_no_row_of_correlated_noise():
    """Correlated noise moves its state (the rows of C^{-1} z) when it is drawn: a step
    refused for a non-finite gradient must not draw it, or every later step's noise
    is the next row of the one it is accounted as (the noise was drawn straight into
    the gradient buffers before clipping, and ran one row ahead of the accountant)."""
    from privlearn.errors import NonFiniteInputError

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_data(32), batch_size=2), noise_multiplier=1.0,
                     max_grad_norm=1.0, seed=0, noise="banded", sampling="cyclic_poisson",
                     cycle_length=4, epochs=2)
    k, refused = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the pass ends at the refusal
        for _ in range(2):
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                loss = nn.functional.cross_entropy(p.model(x), y, reduction="none")
                if not refused and len(y):
                    loss = loss * torch.tensor([float("nan")] + [1.0] * (len(y) - 1))
                loss.sum().backward()
                try:
                    p.optimizer.step()
                except NonFiniteInputError:
                    refused.append(k)
                k += 1
    assert len(refused) == 1 and p.accountant.steps > 4
    assert p.optimizer.correlated.steps == p.accountant.steps


def test_a_batch_left_without_its_step_is_dropped_by_the_new_pass_the_refusal_names():
    """A loop that skips a batch (no step for it) is refused at the next step, which
    would train on two draws. The refusal says what works: a new pass over the loader
    drops the batches no step used, and training goes on from there, every step charged
    once. It advised calling step() without backward(), which is itself refused for a
    batch with examples (a step of noise alone is an empty Poisson batch's only)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 2))
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(_data(), batch_size=16), noise_multiplier=1.0,
                     max_grad_norm=1.0, seed=0, sampling="fixed")
    trained = 0
    for k, (x, y) in enumerate(p.data_loader):
        if k == 1:
            continue  # skipped: no step for this batch
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        if k == 2:
            with pytest.raises(TrainingLoopError, match="start a new pass over p.data_loader"):
                p.optimizer.step()
            break
        p.optimizer.step()
        trained += 1
    for x, y in p.data_loader:  # the new pass the refusal names
        p.optimizer.zero_grad()
        nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        trained += 1
    assert trained == 5 and p.accountant.steps == 5
