"""The metrics' math on features, in float64: FID (Frechet distance of Gaussians fitted to Inception pool features),
Inception Score (from logits), precision/recall (Kynkaenniemi et al. 2019, k-NN manifolds) and CLIP score (from
embeddings). No model here: opendit.eval.features turns images into the features these take."""
import numpy as np
import torch


def feature_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of [N, D] features in float64; sigma is the unbiased covariance (np.cov, as ADM and pytorch-fid)."""
    feats = np.asarray(features, dtype=np.float64)
    if feats.ndim != 2 or len(feats) < 2:
        raise ValueError(f"need at least 2 feature vectors of shape [N, D] for statistics, got {feats.shape}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix (tiny negative eigenvalues -> 0)."""
    w, v = np.linalg.eigh((matrix + matrix.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^1/2), in float64.

    Tr((S1 S2)^1/2) is taken as the sum of the square roots of the eigenvalues of S1^1/2 S2 S1^1/2 (a symmetric
    PSD matrix similar to S1 S2, so the same eigenvalues): no complex round-off to discard and no eps offset for
    singular covariances, unlike scipy.linalg.sqrtm(S1 @ S2) in ADM's and pytorch-fid's code, which it equals to
    round-off where sqrtm is well conditioned."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (len(mu1), len(mu1)):
        raise ValueError(f"statistics of different shapes: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {sigma1.shape} vs {sigma2.shape} (features of different extractors?)")
    diff = mu1 - mu2
    root1 = _sqrt_psd(sigma1)
    middle = root1 @ sigma2 @ root1
    eig = np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.sqrt(eig).sum())


def inception_score(logits: np.ndarray, splits: int = 10) -> tuple[float, float]:
    """(mean, std) over `splits` consecutive, equal parts (np.array_split, no shuffling) of
    exp(E_x KL(p(y|x) || p(y))), p(y|x) = softmax(logits) and p(y) the part's mean. As in ADM's evaluator the
    logits are the Inception's pool features times the fc weight without its bias ("logits_unbiased")."""
    logp = torch.log_softmax(torch.as_tensor(np.asarray(logits), dtype=torch.float64), dim=1)
    if logp.ndim != 2 or len(logp) < splits or splits < 1:
        raise ValueError(f"inception score: need [N, classes] logits with N >= splits ({splits}), "
                         f"got {tuple(logp.shape)}")
    scores = []
    for part in torch.tensor_split(logp, splits):
        log_py = torch.logsumexp(part, dim=0) - np.log(len(part))  # log of the mean of p(y|x)
        kl = (part.exp() * (part - log_py)).sum(dim=1).mean()
        scores.append(float(kl.exp()))
    return float(np.mean(scores)), float(np.std(scores))


def _knn_radii(feats: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Distance of each row to its k-th nearest row, itself included as the 0th (as Kynkaenniemi et al.'s code)."""
    if len(feats) <= k:
        raise ValueError(f"precision/recall with k={k} needs more than {k} images per set, got {len(feats)}")
    return torch.cat([torch.cdist(feats[i:i + chunk], feats).topk(k + 1, dim=1, largest=False).values[:, -1]
                      for i in range(0, len(feats), chunk)])


def _coverage(queries: torch.Tensor, points: torch.Tensor, radii: torch.Tensor, chunk: int) -> float:
    """Fraction of queries within radii[j] of some points[j]."""
    inside = [(torch.cdist(queries[i:i + chunk], points) <= radii[None]).any(dim=1)
              for i in range(0, len(queries), chunk)]
    return float(torch.cat(inside).double().mean())


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = 3, device="cpu",
                     chunk: int = 1024) -> tuple[float, float]:
    """Improved precision and recall (Kynkaenniemi et al. 2019): precision = the fraction of fake features inside
    the real manifold (the union of balls around each real feature with radius its distance to its k-th nearest
    real neighbour), recall = the fraction of real features inside the fake manifold. Distances in float32 on
    `device` (ADM's evaluator: k=3, float32), `chunk` rows at a time."""
    real_t = torch.as_tensor(np.asarray(real), dtype=torch.float32, device=device)
    fake_t = torch.as_tensor(np.asarray(fake), dtype=torch.float32, device=device)
    if real_t.ndim != 2 or fake_t.ndim != 2 or real_t.shape[1] != fake_t.shape[1]:
        raise ValueError(f"precision/recall: features of shapes {tuple(real_t.shape)} and {tuple(fake_t.shape)}")
    precision = _coverage(fake_t, real_t, _knn_radii(real_t, k, chunk), chunk)
    recall = _coverage(real_t, fake_t, _knn_radii(fake_t, k, chunk), chunk)
    return precision, recall


def clip_scores(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Per pair 100 * max(cos(image, text), 0), as torchmetrics' CLIPScore (whose value is their mean)."""
    image = torch.nn.functional.normalize(image_embeds.double(), dim=-1)
    text = torch.nn.functional.normalize(text_embeds.double(), dim=-1)
    return (100 * (image * text).sum(dim=-1)).clamp(min=0)
