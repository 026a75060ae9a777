"""The pfl-research side of ``fedlight bench --peers`` (pfl 0.6.0, PyTorch; imported only in that side's process).

The same MLP and initial weights, the clients of every round in the driver's order (a sampler that replays them),
SGD with the recipe's weight decay, pfl's local joint clip (``local_max_grad_norm``), the per-round lr decay as an
adaptive hyperparameter, FedAvg with a central SGD at lr 1, and central evaluation on the test set every round.
A round ends on the benchmark's clock (:class:`fedlight.lab.benchmarks.work.RoundClock`) in the last callback of its
central iteration, after the evaluation.
"""

from __future__ import annotations

import functools


def run_pfl(work: str, out: dict) -> None:
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.hyperparam.base import HyperParam
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    from fedlight.lab.benchmarks.work import RoundClock, _digest, load_work, mlp_like
    from fedlight.models import MLP

    init, client, test, s = load_work(work)
    clock = RoundClock(out)

    class Net(MLP):
        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            self.eval() if eval else self.train()
            logits = self(x)
            n = len(y)
            return {"loss": Weighted(F.cross_entropy(logits, y, reduction="sum").item(), n),
                    "accuracy": Weighted((logits.argmax(1) == y).sum().item(), n)}

    class Rounds(HyperParam, TrainingProcessCallback):
        """The local lr η_r = lr · decay^(r-1); the last callback of a central iteration (after the evaluation),
        where the round ends on the benchmark's clock."""

        def __init__(self):
            self.r = 0

        def value(self):
            return s["lr"] * s["decay"] ** self.r

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.r += 1
            clock.tick()
            return False, Metrics()

    class Evaluation(CentralEvaluationCallback):
        """pfl's central evaluation, which keeps the test accuracy: pfl evaluates before the first round and after
        every round but the first (as many evaluations as fedlight's, the last of the final model)."""

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stop, metrics = super().after_central_iteration(aggregate_metrics, model,
                                                            central_iteration=central_iteration)
            out["acc"] = next((float(v.overall_value) for k, v in metrics if "accuracy" in str(k)), out.get("acc"))
            return stop, metrics

    net = mlp_like(init, Net)
    out["digest"] = _digest(net.state_dict())
    order = iter([c for ids in s["sampled"] for c in ids])

    def sampler():
        cid = next(order)
        out["sampled"][-1:] = [out["sampled"][-1] + [cid]] if out["sampled"] and len(
            out["sampled"][-1]) < len(s["sampled"][0]) else [*out["sampled"][-1:], [cid]]
        return cid

    data = FederatedDataset(lambda cid: Dataset(raw_data=list(client(cid)), user_id=str(cid)), sampler)
    model = PyTorchModel(model=net, local_optimizer_create=functools.partial(torch.optim.SGD,
                         weight_decay=s["weight_decay"]), central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    lr = Rounds()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=s["rounds"], evaluation_frequency=1,
                                           train_cohort_size=len(s["sampled"][0]), val_cohort_size=0),
        backend=SimulatedBackend(training_data=data, val_data=None),
        model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=s["epochs"], local_learning_rate=lr,
                                              local_batch_size=s["batch_size"], local_max_grad_norm=s["clip"]),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[Evaluation(Dataset(raw_data=list(test)), NNEvalHyperParams(local_batch_size=1000)),
                   lr])
