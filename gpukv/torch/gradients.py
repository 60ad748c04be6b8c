"""The gradients a step takes: each replica's in its bucket view, checked to be fresh and
of a parameter the Trainer trains."""
from __future__ import annotations

import torch

from .._errors import ArgumentError
from .buckets import Bucket
from .fresh import FreshGrads
from .registrations import registrations


class GradientCollector:
    """Puts every replica's gradients into the bucket views before a step, and refuses
    (or with `ignore_stale_grad` zeroes) the stale ones: those backward has not written
    since the last step.

    `frozen`: (name, replica, tensor) of the parameters frozen when the Trainer was made,
    which have no key.
    """

    def __init__(self, buckets: list[Bucket], frozen: list, modules: list) -> None:
        self._buckets = buckets
        self._frozen = frozen
        self._modules = modules
        self._replicas = len(modules)
        #: the parameters the Trainer was made with (the buckets keep them alive)
        self._known = {id(p) for b in buckets for params in b.params for p in params}
        #: `registrations()` when the replicas' parameters were last found all known
        self._walked = registrations()
        self._fresh = FreshGrads(buckets)
        #: [bucket][replica][i]: where each parameter's weights are (`note_weights`)
        self._where: list = []

    def note_weights(self) -> None:
        """Note where every parameter's weights are, once they are views of the buckets'
        buffers (`buckets.flatten`): a step refuses a parameter moved elsewhere since."""
        self._where = [[[p.data_ptr() for p in params] for params in bucket.params]
                       for bucket in self._buckets]

    def check_trainable(self) -> None:
        """ArgumentError naming the parameters frozen when the Trainer was made and
        trainable now: they have no key, and would get gradients that nothing applies."""
        thawed = [(name, r) for name, r, p in self._frozen if p.requires_grad]
        if thawed:
            name, r = thawed[0]
            raise ArgumentError(
                f"parameter {name!r} of replica {r} had requires_grad=False when the Trainer "
                f"was made and is trainable now: the Trainer leaves out the parameters "
                f"frozen when it is made; make a new Trainer after unfreezing it "
                f"({len(thawed)} such parameter(s) in all)")
        now = registrations()
        if now == self._walked:  # nothing registered anywhere: nothing new to find
            return
        for r, module in enumerate(self._modules):
            for name, p in module.named_parameters():
                if p.requires_grad and id(p) not in self._known:
                    raise ArgumentError(
                        f"parameter {name!r} of replica {r} is not one the Trainer was "
                        f"made with (a layer added or replaced since, or "
                        f"load_state_dict(assign=True)): it has no key, and nothing would "
                        f"update it; make a new Trainer after changing the model")
        self._walked = now

    def collect(self, ignore_stale_grad: bool) -> list[Bucket]:
        """Put every replica's gradient into its bucket view; return the buckets to step.

        Checks every parameter before anything changes. A stale gradient is an
        ArgumentError, or with `ignore_stale_grad` zeroed; a bucket of one parameter
        stale in every replica is left out.
        """
        onto_sums = self._fresh.added_to_sums()
        if onto_sums is not None:
            name, r = onto_sums
            raise ArgumentError(
                f"parameter {name!r} of replica {r}: backward added its gradient to the sum "
                f"over the replicas that the last step left in .grad (update_on_kvstore="
                f"False leaves the sums there, as gluon does), and this step would sum "
                f"those sums again; call zero_grad() (the Trainer's, or the model's) before "
                f"backward")
        stale: list = []  # (bucket, replica, index) of each gradient backward left alone
        adopted: list = []  # (param, view, grad): a new tensor since set_to_none
        for b, bucket in enumerate(self._buckets):
            for r, (params, views) in enumerate(zip(bucket.params, bucket.views)):
                fresh = self._fresh.marks(b, r)
                where = self._where[b][r]
                for i, (p, view) in enumerate(zip(params, views)):
                    if p.data_ptr() != where[i]:
                        raise ArgumentError(_moved_message(bucket.names[i], r))
                    grad = p.grad  # one read: a Parameter's .grad is not a cheap attribute
                    if grad is view:
                        if not fresh[i]:
                            stale.append((bucket, r, i))
                    elif grad is None:
                        stale.append((bucket, r, i))
                    else:
                        adopted.append((p, view, grad))
        if stale:
            _refuse_frozen(stale)  # backward skips a frozen parameter: say why
            if not ignore_stale_grad:
                raise ArgumentError(_stale_message(stale))
        missing: dict = {}
        with torch.no_grad():
            for bucket, r, i in stale:
                bucket.views[r][i].zero_()
                missing[id(bucket)] = missing.get(id(bucket), 0) + 1
            for p, view, grad in adopted:
                _adopt(p, view, grad)
        return [b for b in self._buckets if b.fused or missing.get(id(b), 0) < self._replicas]

    def adopt_replaced(self) -> None:
        """Copy each gradient that is a new tensor, not its view (clipping out of place),
        into its view: that is what gets applied."""
        replaced = [(p, view, p.grad) for bucket in self._buckets
                    for params, views in zip(bucket.params, bucket.views)
                    for p, view in zip(params, views)
                    if p.grad is not None and p.grad is not view]
        with torch.no_grad():
            for p, view, grad in replaced:
                _adopt(p, view, grad)

    def stepped(self) -> None:
        """A step or an update used the gradients, or zero_grad dropped them: none is
        fresh any more."""
        self._fresh.clear()

    def hold_sums(self, buckets: list[Bucket]) -> None:
        """The step just taken left the replicas' sums in the gradients of `buckets`: a
        backward adding to them before the next step is refused there (`collect`)."""
        self._fresh.hold_sums(buckets)


def _moved_message(name: str, r: int) -> str:
    return (f"parameter {name!r} of replica {r} no longer holds the weights the Trainer "
            f"updates: a model.to(...) (another dtype or memory format), .double(), "
            f".half() or a .data set since the Trainer was made gave it new memory, which "
            f"no step would update; convert the model first, then make the Trainer (or "
            f"make a new one)")


def _refuse_frozen(stale: list) -> None:
    """ArgumentError naming a stale parameter that is frozen now (it was trainable when
    the Trainer was made): its key would still move it (weight decay, momentum)."""
    for bucket, r, i in stale:
        if not bucket.params[r][i].requires_grad:
            raise ArgumentError(
                f"parameter {bucket.names[i]!r} of replica {r} was trainable when the "
                f"Trainer was made and is frozen now: its key would still move it "
                f"(weight decay, momentum); make a new Trainer after freezing it")


def _adopt(p, view, grad) -> None:
    """A .grad replaced by a new tensor goes into its bucket view, the .grad again."""
    copy_gradient(view, grad)
    p.grad = view


def copy_gradient(view, grad) -> None:
    """`view` = `grad`, a sparse one (nn.Embedding(sparse=True) after `.grad` was set to
    None) made dense: the buckets hold dense gradients, and later sparse gradients add
    into them as backward does."""
    view.copy_(grad.to_dense() if grad.is_sparse else grad)


def _stale_message(stale: list) -> str:
    """The stale gradients of the lowest-numbered replica that has some, named."""
    r = min(rr for _, rr, _ in stale)
    names = [bucket.names[i] for bucket, rr, i in stale if rr == r]
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    return (f"parameter{'s' if len(names) > 1 else ''} {shown} of replica {r}: stale "
            f"gradient ({len(names)} in this replica, {len(stale)} in all): backward has "
            f"not written it since the last step (.grad is None or as it was; a step "
            f"without backward, backward on some replicas only, or a parameter the forward "
            f"pass did not use); call step(..., ignore_stale_grad=True) to leave it out")
