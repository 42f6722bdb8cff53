"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022) as a
plug-in, with the clients' models averaged as FedAvg does (fedfast trains one model architecture): the example of a
method that reads each trained client's own data after its local training (``Engine.client_data``).

A class's **prototype** is the mean of the representations ``f(x)`` (the classifier's input, ``Step.features``)
of a client's samples of that class. With ``C_bar`` the global prototypes, each client trains on

    CE(z, y) + ld * MSE(f(x), C_bar[y])

the MSE a mean over the minibatch's rows and the F features, a row whose class has no global prototype counting
zero (the code's ``loss_mse(protos_new, proto)`` with the row's own features as target). After its local training,
each client's local prototype of class j is the mean of ``f(x)`` over its samples of class j, from one pass of the
trained model over its own data: eval mode, un-augmented, every sample once (``Engine.client_data``; the authors'
code averages the features of its training batches instead, in training mode, before each step's update). The
server's global prototype of class j is the plain mean of the round's clients' local prototypes of j (the code's
``proto_aggregation``), for the classes some client of the round holds; a class no client of the round holds has
none in the next round. Round 1 has no global prototypes (CE alone).

    fedfast run --plugin examples/fedproto.py --set algorithm=fedproto --set fedproto.ld=1.0

``tests/test_fedproto_example.py`` checks it against a literal per-client loop (``nn.Module``, ``torch.optim.SGD``,
a forward hook for the features, the prototypes from a pass over each client's data, ``state_dict`` averaging).
"""

from dataclasses import dataclass

import torch

from fedfast.methods import Collected, FedAvg, opt, register
from fedfast.methods.hooks import cross_entropy, weighted_mean_rows


@register("fedproto")
class FedProto(FedAvg):
    """FedProto (Tan et al. 2022): CE + ld * MSE(f(x), the global prototype of x's class); prototypes are class
    means of the representation, the global ones the mean over the round's clients of theirs."""

    paper = "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"
    needs_features = True  # the loss reads Step.features, the classifier's input

    @dataclass
    class Options:
        ld: float = opt(1.0, "lambda, the prototype term's weight (Eq. 8; the code's --ld, 1 by default)", check=">=0")

    def setup(self):
        e = self.engine
        C, F = e.num_classes, e.feature_width
        self.protos = torch.zeros(C, F, device=e.device)  # global prototypes, [C, F]
        self.has = torch.zeros(C, dtype=torch.bool, device=e.device)  # the classes that have one

    def round_start(self, ctx):
        e = self.engine  # the round's sums over its clients (and processes): collect adds to them
        return {
            "proto_sum": torch.zeros(e.num_classes, e.feature_width, device=e.device),
            "proto_clients": torch.zeros(e.num_classes, device=e.device),
        }

    def loss(self, ctx, b):
        y = b.target.clamp_min(0)  # padding rows (target -100) are masked by weighted_mean_rows
        f = b.features.reshape(y.shape[0], -1)
        d = ((f - self.protos[y]) ** 2).mean(1) * self.has[y]
        return cross_entropy(b, self.engine.backend) + self.opts.ld * weighted_mean_rows(d, b.valid)

    def collect(self, ctx, out, lo, hi):
        e, n = self.engine, hi - lo
        C, F = e.num_classes, e.feature_width
        sums = torch.zeros(n * C, F, device=e.device)
        counts = torch.zeros(n * C, device=e.device)
        for part in e.client_data(ctx, lo, hi, features=True):  # the trained clients over their own data
            key = (torch.arange(n, device=e.device)[:, None] * C + part.y.clamp_min(0)).reshape(-1)
            w = part.valid.reshape(-1).float()
            sums.index_add_(0, key, part.features.reshape(-1, F) * w[:, None])
            counts.index_add_(0, key, w)
        holds = (counts > 0).view(n, C)
        local = (sums / counts.clamp_min(1)[:, None]).view(n, C, F)  # each client's local prototypes
        # the chunk's shares of the round's sums (the engine adds the chunks' and ranks')
        return Collected(sums={"proto_sum": (local * holds[..., None]).sum(0), "proto_clients": holds.sum(0)})

    def server(self, ctx, avg):
        k = ctx.sums["proto_clients"]  # summed over every rank's clients by the engine before server
        self.has = k > 0
        self.protos = ctx.sums["proto_sum"] / k.clamp_min(1)[:, None]
        return super().server(ctx, avg)
