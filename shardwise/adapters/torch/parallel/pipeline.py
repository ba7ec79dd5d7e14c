"""Run a core pipeline :class:`~shardwise.core.pipeline.Schedule` on PyTorch modules.

Each pipeline rank holds ``schedule.virtual_stages`` model chunks (chunk ``c`` of
rank ``r`` is model stage ``c * p + r``) and runs its own action list in order:
forwards keep their input and output for the backward, backwards call
``torch.autograd.backward(output, output_grad)``, sends are non-blocking (their
handles are waited at the end of the step) and receives block, which is the
contract under which every core schedule is deadlock-free. Messages towards
higher ranks travel on ``pp_comm``, messages towards lower ranks on ``down_comm``
(the same ranks with connections of their own: ``ParallelGroups.pp_down``, or
else ``pp_comm.duplicate()`` made at construction where the backend can): on
gloo the two directions between a pair of ranks would otherwise share, and
queue on, one connection. Before each compute
action the next few receives are posted (non-blocking), so their messages land while
this rank computes instead of when it asks for them. Receives from each peer are posted
in the order that peer sends (:func:`~shardwise.core.pipeline_arrivals.arrival_order`),
stopping at the first whose buffer cannot be sized yet rather than skipping it: NCCL
ignores tags and pairs messages by order. Message tags come from :meth:`Schedule.tag`,
so they match on both ends elsewhere, once every rank has agreed at the start of the
step that it runs the same schedule in the same mode
(:class:`~.pipeline_wire.StepAgreement`: otherwise a
:class:`~shardwise.core.errors.DivergenceError` on every rank). Received activations and
gradients are allocated on the device of this rank's chunks.

The last model stage applies ``loss_fn(output, target)`` (a mean over the
micro-batch) divided by the number of micro-batches, so the accumulated
gradients equal those of one full-batch step (micro-batches must be equal-sized).
Linear layers add each micro-batch's weight gradient to ``.grad`` inside the
GEMM that computes it (:class:`~.wgrad.WeightGradFusion`) instead of in a
separate pass per micro-batch, and those GEMMs wait until the backward's input
gradient has been sent (:class:`~.wgrad.DeferredWeightGrads`): the previous stage,
which waits for that gradient, gets it one weight-gradient pass sooner. Pipeline
rank ``r`` keeps the weight GEMMs of up to ``r`` backward passes queued past its
next compute action (older ones run while it waits for a message, where the
backend can tell), so the GEMMs of its last backwards fill the tail where it waits
for the ``r`` stages before it to finish theirs (zero-bubble's ZB-H1 placement of
weight passes). With 1F1B's ``p - r`` micro-batches in flight on rank ``r``, that
holds no more than rank 0 holds. Every queued accumulation runs before ``step`` returns.

A loss term over the whole step (``balance``: a Mixture-of-Experts router's load-balancing
loss, :class:`~.experts.router_balance.PipelineBalance`) is kept per micro-batch by each stage's
forwards, met over the stages after this rank's last forward and its sends (a collective, so
the schedule must run every forward before the first backward), and each backward adds its
micro-batch's part.

A rank that raises during a step tells the other pipeline ranks (a small message on a tag of
its own, whose receive each rank keeps posted) and each of them, waiting for a message from
any rank, raises :class:`~shardwise.core.errors.PeerFailedError` instead of waiting forever;
the executor then refuses further steps on every rank. That needs receives whose completion
can be polled (the ``mpi`` backend); elsewhere a rank waits as before (the backend's timeout).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ....core.comm import Communicator, Handle
from ....core.errors import ConfigError, DivergenceError, PeerFailedError
from ....core.pipeline import Action, Schedule
from ....core.pipeline_arrivals import arrival_order
from .pipeline_wire import (HEADER_LEN, StepAgreement, connect, control_device, duplicate_or_same, make_header,
                            read_header)
from .wgrad import DeferredWeightGrads, WeightGradFusion

__all__ = ["PipelineExecutor"]

ShapeSpec = Union[Sequence[int], Callable[[int], Sequence[int]]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]



@dataclasses.dataclass
class _StepState:
    """Tensors of one step, keyed by ``(microbatch, chunk)``."""

    inputs: dict = dataclasses.field(default_factory=dict)
    outputs: dict = dataclasses.field(default_factory=dict)
    out_grads: dict = dataclasses.field(default_factory=dict)
    in_grads: dict = dataclasses.field(default_factory=dict)
    results: dict = dataclasses.field(default_factory=dict)
    pending: list = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)
    posted: dict = dataclasses.field(default_factory=dict)  # receive action -> (handle, buffer)
    arrivals: dict = dataclasses.field(default_factory=dict)  # peer -> its messages in arrival order
    arrival_index: dict = dataclasses.field(default_factory=dict)  # receive -> its place in its peer's order
    next_arrival: dict = dataclasses.field(default_factory=dict)  # peer -> index of the next one to post
    number: int = 0  # the step's number, agreed by every pipeline rank
    deferred: DeferredWeightGrads = dataclasses.field(default_factory=DeferredWeightGrads)
    loss: Optional[torch.Tensor] = None


class PipelineExecutor:
    """Runs this rank's share of a pipeline schedule over its model chunk(s).

    ``chunks`` is one module, or ``schedule.virtual_stages`` modules for an
    interleaved schedule (chunk order). ``activation_shape`` fixes the shape of
    every received activation (one shape, or a function of the receiving model
    stage); without it, the first micro-batch of each step sends a small shape
    header first. ``checkpoint`` recomputes chunk forwards in backward
    (``torch.utils.checkpoint``), for all chunks or per chunk.
    ``fuse_weight_grads`` (default True) accumulates linear layers' weight
    gradients across micro-batches in place (see :mod:`.wgrad`). ``down_comm``
    carries the messages towards lower pipeline ranks (default: a duplicate of
    ``pp_comm``, whose creation is collective over the pipeline group, or
    ``pp_comm`` itself where the backend cannot duplicate a sub-group).
    """

    #: Receives posted ahead of need, at most (each holds one micro-batch's activation or
    #: gradient buffer). One was too few for interleaved schedules, whose next receives alternate
    #: between chunks and directions: posting four took 12-18 % off their step on 2 and 4 CPU
    #: ranks over gloo. Many more would have 1F1B hold buffers for micro-batches far ahead.
    RECV_LOOKAHEAD = 4

    def __init__(self, chunks: Union[nn.Module, Sequence[nn.Module]], schedule: Schedule,
                 pp_comm: Communicator, loss_fn: Optional[LossFn] = None, *,
                 activation_shape: Optional[ShapeSpec] = None,
                 activation_dtype: Optional[torch.dtype] = None,
                 checkpoint: Union[bool, Sequence[bool]] = False, fuse_weight_grads: bool = True,
                 down_comm: Optional[Communicator] = None, balance: Optional[Any] = None) -> None:
        self.chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        p, v = schedule.num_stages, schedule.virtual_stages
        if pp_comm.size != p:
            raise ConfigError(f"schedule {schedule.name!r} has {p} stages but the pp communicator "
                              f"has {pp_comm.size} ranks")
        if len(self.chunks) != v:
            raise ConfigError(f"schedule {schedule.name!r} has virtual_stages={v} but this rank "
                              f"got {len(self.chunks)} model chunk(s)")
        flags = [checkpoint] * v if isinstance(checkpoint, bool) else list(checkpoint)
        if len(flags) != v:
            raise ConfigError(f"checkpoint has {len(flags)} flags for {v} chunk(s)")
        self.schedule, self.comm, self.loss_fn = schedule, pp_comm, loss_fn
        if balance is not None and not _forwards_first(schedule):
            raise ConfigError(f"a loss over the whole step (the router load-balancing loss) needs every forward "
                              f"before the first backward on each rank; schedule {schedule.name!r} interleaves "
                              f"them (use 'gpipe')")
        #: The step's load-balancing loss (PipelineBalance), or None.
        self.balance = balance
        self.rank, self.checkpoint = pp_comm.rank, flags
        self.fuse_weight_grads = bool(fuse_weight_grads)
        self._down = down_comm if down_comm is not None else duplicate_or_same(pp_comm)
        if (self._down.size, self._down.rank) != (p, self.rank):
            raise ConfigError(f"down_comm has rank {self._down.rank} of {self._down.size}; the pipeline "
                              f"communicator has rank {self.rank} of {p}")
        self.num_model_stages = p * v
        #: Backward passes whose weight GEMMs may stay queued past the next compute action
        #: (see the module docstring): the ranks before this one take that long to finish.
        self._wgrad_lag = self.rank
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype or torch.get_default_dtype()
        #: Where received activations and gradients are allocated: the device of this rank's chunks.
        self.device = next((t.device for c in self.chunks for t in itertools.chain(c.parameters(), c.buffers())),
                           torch.device("cpu"))
        self._control = control_device(pp_comm, self.device)
        #: Per mode (training, prediction) and peer, this rank's receives in the order the peer sends them.
        self._arrivals = {train: arrival_order(schedule, self.rank, forward_only=not train,
                                               headers=activation_shape is None) for train in (True, False)}
        #: Per mode, where each receive stands in its peer's arrival order.
        self._arrival_index = {train: {a: i for order in orders.values() for i, (a, _) in enumerate(order)}
                               for train, orders in self._arrivals.items()}
        self._agree = StepAgreement(pp_comm, schedule, activation_shape is None, self._control)
        if self.is_last and loss_fn is None:
            raise ConfigError(f"pipeline rank {self.rank} holds the last model stage and needs a loss_fn")
        connect(schedule, self.rank, self.comm, self._down, self.device)
        #: The pipeline rank whose failure ended a step (this one included), or None.
        self._failed: Optional[int] = None
        self._failure_sends: list = []
        self._failed_step: Optional[_StepState] = None
        #: Per peer, the posted receive of its failure notice (only where receives can be polled).
        self._notices: dict[int, tuple[Handle, torch.Tensor]] = {}
        self._notice_tag = _notice_tag(pp_comm, self._meta_tag(self.num_model_stages))
        if p > 1 and self._notice_tag is not None and _polls_by_tag(pp_comm) and _polls_by_tag(self._down):
            for peer in range(p):
                if peer != self.rank:
                    buf = torch.zeros(2, dtype=torch.int64)
                    self._notices[peer] = (self._from(peer).recv_async(buf, peer, self._notice_tag), buf)

    @property
    def is_first(self) -> bool:
        """True when this rank holds model stage 0 (it consumes the inputs)."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """True when this rank holds the last model stage (it computes the loss)."""
        return self.rank == self.schedule.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of all chunks of this rank."""
        return [q for c in self.chunks for q in c.parameters()]

    # ------------------------------------------------------------------ public
    def step(self, inputs: Optional[torch.Tensor] = None,
             targets: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward and backward of one batch; gradients accumulate into ``.grad``.

        ``inputs`` is needed on the first rank, ``targets`` on the last (others
        ignore them). Returns the batch's mean loss on the last rank, else ``None``.
        """
        state = self._run(inputs, targets, self.schedule.actions[self.rank], train=True)
        return state.loss

    @torch.no_grad()
    def predict(self, inputs: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward only (no loss, no gradients); the last rank returns the concatenated outputs."""
        forwards = [a for a in self.schedule.actions[self.rank]
                    if a.kind in ("forward", "send_act", "recv_act")]
        state = self._run(inputs, None, forwards, train=False)
        if not self.is_last:
            return None
        return torch.cat([state.results[i] for i in range(self.schedule.num_microbatches)])

    # --------------------------------------------------------------- internals
    def _split(self, batch: Optional[torch.Tensor], what: str) -> list[torch.Tensor]:
        m = self.schedule.num_microbatches
        if batch is None:
            raise ConfigError(f"pipeline rank {self.rank} needs {what} for its stage")
        if batch.dim() == 0 or batch.shape[0] % m:
            raise ConfigError(f"{what} batch size {tuple(batch.shape)[:1]} is not divisible by "
                              f"num_microbatches={m} of schedule {self.schedule.name!r}")
        return list(batch.chunk(m)) if m > 1 else [batch]

    def _run(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
             actions: Sequence[Action], train: bool) -> _StepState:
        if self._failed is not None:
            raise PeerFailedError(f"an earlier step failed on pipeline rank {self._failed}: this pipeline's "
                                  f"messages are out of step; parallelize the model again")
        number = self._agree(train)  # raises alike on every rank
        # a bad batch is refused before anything moves (ParallelModel checks it on every rank first)
        mb_inputs = self._split(inputs, "inputs") if self.is_first else None
        mb_targets = self._split(targets, "targets") if self.is_last and train else None
        state = _StepState(number=number, arrivals=self._arrivals[train], arrival_index=self._arrival_index[train])
        try:
            return self._run_step(state, mb_inputs, mb_targets, actions, train)
        except BaseException as exc:
            # the step's posted receives may still be written into, its sends still read: keep their buffers
            self._failed_step = state
            if not isinstance(exc, PeerFailedError):
                self._tell_peers()
            raise

    def _tell_peers(self) -> None:
        """After this rank raised mid-step: tell every other pipeline rank (where they listen)."""
        self._failed = self.rank
        for peer in self._notices:
            msg = torch.tensor([1, self._agree.steps], dtype=torch.int64)
            self._failure_sends.append((self._to(peer).send_async(msg, peer, self._notice_tag), msg))

    def _check_peers(self) -> None:
        """:class:`PeerFailedError` where another pipeline rank has said it failed."""
        for peer, (handle, buf) in self._notices.items():
            if handle.done():
                handle.wait()
                self._failed = peer
                raise PeerFailedError(f"pipeline rank {peer} raised during step {int(buf[1]) - 1} (see its error); "
                                      f"pipeline rank {self.rank} stops waiting for it")

    def _wait(self, handle: Handle) -> Any:
        """``handle.wait()``, watching for a failed peer meanwhile (where receives can be polled)."""
        if not self._notices:
            return handle.wait()
        spins, pause = 0, 0.0
        while not handle.done():
            self._check_peers()
            spins += 1
            if spins > 200:
                time.sleep(pause)
                pause = min(max(pause * 2, 1e-6), 1e-4)
        return handle.wait()

    def _run_step(self, state: _StepState, mb_inputs: Optional[list], mb_targets: Optional[list],
                  actions: Sequence[Action], train: bool) -> _StepState:
        if self.balance is not None:
            self.balance.begin_step()
        self._act(actions, state, mb_inputs, mb_targets, train)
        for handle, _ in state.pending:  # not on error: a failed peer would never receive
            self._wait(handle)
        return state

    def _act(self, actions: Sequence[Action], state: _StepState, mb_inputs: Optional[list],
             mb_targets: Optional[list], train: bool) -> None:
        lag = self._wgrad_lag
        meet_at = _meeting_point(actions) if train and self.balance is not None else -1
        for k, a in enumerate(actions):
            if k == meet_at:
                # after this rank's last forward and its sends, before anything that waits for a peer
                self.balance.meet()
            if a.kind == "forward":
                state.deferred.flush(keep=lag)
                self._post_recvs(actions, k, state)
                self._forward(a, state, mb_inputs, mb_targets, train)
            elif a.kind == "backward":
                state.deferred.flush(keep=lag)
                self._post_recvs(actions, k, state)
                self._backward(a, state)
                state.deferred.seal()
            elif a.kind == "recv_act":
                state.inputs[(a.microbatch, a.chunk)] = _as_leaf(self._recv(a, state))
            elif a.kind == "recv_grad":
                state.out_grads[(a.microbatch, a.chunk)] = self._recv(a, state)
            else:
                self._send(a, state)
        state.deferred.flush()

    def _post_recvs(self, actions: Sequence[Action], k: int, state: _StepState) -> None:
        """Post the next :attr:`RECV_LOOKAHEAD` receives after action ``k``, as far as their shapes are known."""
        upcoming = (a for a in itertools.islice(actions, k + 1, None) if a.kind in ("recv_act", "recv_grad"))
        for a in itertools.islice(upcoming, self.RECV_LOOKAHEAD):
            self._post_through(a, state, wait=False)

    def _post_through(self, a: Action, state: _StepState, wait: bool) -> None:
        """Post the receives from ``a.peer`` in arrival order up to ``a`` (:mod:`~shardwise.core.pipeline_arrivals`).

        Each receive is posted once. Without ``wait`` it stops at the first one whose shape is
        still unknown (a gradient whose forward has not run, an activation whose header has not
        come); with ``wait`` it receives such headers.
        """
        peer, last = a.peer, state.arrival_index[a]
        queue, n = state.arrivals[peer], state.next_arrival.get(peer, 0)
        while n <= last:
            receive, after_header = queue[n]
            spec = self._buffer_spec(receive, state)
            if spec is None:
                if not (wait and after_header):
                    if wait:
                        raise DivergenceError(f"pipeline rank {self.rank} must receive {receive} from rank {peer} "
                                              f"before {a}, and does not know its shape yet")
                    break
                self._read_header(receive, state)
                spec = self._buffer_spec(receive, state)
            buf = torch.empty(spec[0], dtype=spec[1], device=spec[2])
            handle = self._from(peer).recv_async(buf, peer, self.schedule.tag(self.rank, receive))
            state.posted[receive] = (handle, buf)
            n += 1
        state.next_arrival[peer] = n

    def _buffer_spec(self, a: Action, state: _StepState) -> Optional[tuple]:
        """``(shape, dtype, device)`` of the buffer that receive ``a`` needs, or None while it is unknown."""
        if a.kind == "recv_grad":
            out = state.outputs.get((a.microbatch, a.chunk))
            return None if out is None else (tuple(out.shape), out.dtype, out.device)
        known = self._known_act_shape(self._stage(a), state)
        return None if known is None else (*known, self.device)

    def _read_header(self, a: Action, state: _StepState) -> None:
        """Receive the shape header that precedes activation ``a`` (blocking)."""
        stage = self._stage(a)
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._control)
        if self._notices:
            self._wait(self._from(a.peer).recv_async(header, a.peer, self._meta_tag(stage)))
        else:
            self._from(a.peer).recv(header, a.peer, self._meta_tag(stage))
        state.meta[stage] = read_header(header, state.number, a.microbatch, stage, a.peer, self.rank)

    def _known_act_shape(self, stage: int, state: _StepState) -> Optional[tuple]:
        if self.activation_shape is not None:
            spec = self.activation_shape
            return tuple(spec(stage) if callable(spec) else spec), self.activation_dtype
        return state.meta.get(stage)

    def _stage(self, a: Action) -> int:
        return self.schedule.model_stage(self.rank, a.chunk)

    def _forward(self, a: Action, state: _StepState, mb_inputs: Optional[list],
                 mb_targets: Optional[list], train: bool) -> None:
        key, stage = (a.microbatch, a.chunk), self._stage(a)
        x = mb_inputs[a.microbatch] if stage == 0 else state.inputs[key]
        state.inputs[key] = x
        chunk = self.chunks[a.chunk]
        if self.balance is not None:
            self.balance.begin_forward()
        if self.checkpoint[a.chunk] and train and torch.is_grad_enabled():
            out = _checkpoint(chunk, x, use_reentrant=False)
        elif train and self.fuse_weight_grads:
            # model stage 0 sends no input gradient: nothing to get out ahead of its weight GEMMs
            with WeightGradFusion(state.deferred if stage > 0 else None):
                out = chunk(x)
        else:
            out = chunk(x)
        if self.balance is not None:
            self.balance.end_forward(a.microbatch)
        if stage == self.num_model_stages - 1:
            state.results[a.microbatch] = out.detach()
            if train:
                loss = self.loss_fn(out, mb_targets[a.microbatch]) / self.schedule.num_microbatches
                state.loss = loss.detach() if state.loss is None else state.loss + loss.detach()
                out = loss
        elif self.schedule.num_stages == 1:  # next stage is the next chunk of this rank
            state.inputs[(a.microbatch, a.chunk + 1)] = _as_leaf(out)
        state.outputs[key] = out

    def _backward(self, a: Action, state: _StepState) -> None:
        key, stage = (a.microbatch, a.chunk), self._stage(a)
        out = state.outputs.pop(key)
        grad = None if stage == self.num_model_stages - 1 else state.out_grads.pop(key)
        tensors, grads = ([out], [grad]) if out.requires_grad else ([], [])
        extra = self.balance.term(a.microbatch) if self.balance is not None else None
        if extra is not None:
            tensors.append(extra)
            grads.append(None)
        if tensors:
            torch.autograd.backward(tensors, grads)
        x = state.inputs.pop(key)
        if stage == 0:
            return
        g = x.grad if x.grad is not None else torch.zeros_like(x)
        if self.schedule.num_stages == 1:
            state.out_grads[(a.microbatch, a.chunk - 1)] = g
        else:
            state.in_grads[key] = g

    def _recv(self, a: Action, state: _StepState) -> torch.Tensor:
        """The tensor that receive ``a`` brings (posting it, and those before it from its peer, if not yet)."""
        self._post_through(a, state, wait=True)
        handle, buf = state.posted.pop(a)
        # compute instead of waiting; never below the lag (gloo's receives report done only once waited)
        while state.deferred.groups > self._wgrad_lag and not handle.done():
            state.deferred.run_oldest()
        out = self._wait(handle)
        return out if torch.is_tensor(out) else buf

    def _send(self, a: Action, state: _StepState) -> None:
        key = (a.microbatch, a.chunk)
        if a.kind == "send_act":
            data = state.outputs[key].detach().contiguous()
            receiver = self._stage(a) + 1
            if self.activation_shape is None and receiver not in state.meta:
                state.meta[receiver] = True
                header = make_header(data, state.number, a.microbatch, receiver, self._control)
                state.pending.append((self._to(a.peer).send_async(header, a.peer, self._meta_tag(receiver)), header))
        else:
            data = state.in_grads.pop(key).contiguous()
        handle: Handle = self._to(a.peer).send_async(data, a.peer, self.schedule.tag(self.rank, a))
        state.pending.append((handle, data))  # the tensor must live until the send completes

    def _to(self, peer: int) -> Communicator:
        """The communicator of messages from this rank to ``peer`` (one per direction)."""
        return self.comm if peer > self.rank else self._down

    def _from(self, peer: int) -> Communicator:
        return self.comm if peer < self.rank else self._down

    def _meta_tag(self, stage: int) -> int:
        return 2 * self.schedule.num_microbatches * self.num_model_stages + stage


def _forwards_first(schedule: Schedule) -> bool:
    """Whether every rank runs all its forwards before its first backward (GPipe's order)."""
    for actions in schedule.actions:
        kinds = [a.kind for a in actions if a.kind in ("forward", "backward")]
        if "backward" in kinds and "forward" in kinds[kinds.index("backward"):]:
            return False
    return True


#: Failure notices travel on tags from here (above every activation, gradient and header tag of
#: pipelines of up to 15000 micro-batches x stages; MPI allows tags up to at least 32767) ...
_NOTICE_TAGS = 30000
#: ... one per executor built on a communicator, in turn: a notice receive an executor left posted
#: (it never completes without a failure) matches no message of the executors built after it.
_NOTICE_SLOTS = 512


def _polls_by_tag(comm: Communicator) -> bool:
    """Whether ``comm`` matches messages by tag and can poll a receive: shardwise's own ``mpi`` backend
    (NCCL ignores tags, gloo reports a receive done only once waited), with no device route: an
    mpi communicator that sends torch tensors through a torch group (``SHARDWISE_DEVICE_ENGINE``)
    has gloo's or NCCL's receives, and waiting on their ``done()`` would spin forever."""
    return (getattr(comm, "backend", None) == "mpi" and type(comm).__module__.startswith("shardwise.backends.")
            and getattr(comm, "device_route", None) is None)


def _notice_tag(comm: Communicator, highest: int) -> Optional[int]:
    """The failure-notice tag of the next executor on ``comm`` (the same on every rank: executors are
    built collectively, in one order), or None where the pipeline's own tags reach that far."""
    if highest >= _NOTICE_TAGS:
        return None
    serial = getattr(comm, "_shardwise_pipeline_notices", 0)
    try:
        setattr(comm, "_shardwise_pipeline_notices", serial + 1)
    except AttributeError:  # a communicator that keeps no attributes: no notices
        return None
    return _NOTICE_TAGS + serial % _NOTICE_SLOTS


def _meeting_point(actions: Sequence[Action]) -> int:
    """Index of the first action after the last forward that is not a send (where a step-wide loss's
    collective runs: every peer has then had this rank's activations); ``len(actions)`` if none."""
    last = max((k for k, a in enumerate(actions) if a.kind == "forward"), default=-1)
    k = last + 1
    while k < len(actions) and actions[k].kind.startswith("send"):
        k += 1
    return k


def _as_leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh autograd leaf holding ``x``'s values (requires grad when floating point)."""
    leaf = x.detach()
    return leaf.requires_grad_() if leaf.is_floating_point() and torch.is_grad_enabled() else leaf
