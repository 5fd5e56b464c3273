"""The figures of a trained run, their intervals, and the statistics of two runs side by side.

evaluate.py         the report of `mmldlm eval` and of evaluation during training: ELBO per mode, l2t
                    reconstruction, t2l cosine and retrieval, length, writing, references (`evaluate`)
figures.py          every figure of a report: its recipe, and the label, format and reference it is shown with
report.py           the report for readers: its markdown (`markdown`), its eval_* metric keys (`eval_metrics`)
intervals.py        bootstrap intervals of a figure (`bootstrap`, the recipes `Mean`, `Rate`, `CorpusStatistic`)
                    and differences of two reports or two arms of runs (`paired_difference`, ...)
compare.py          two reports of the same texts, figure by figure (`mmldlm compare`: `compare_reports`)
text_metrics.py     figures of writing on plain strings: word F1, BLEU, repetition, distinct-n, copies,
                    the n-gram reference (`NgramReference`)
kneser_ney.py       nltk's Kneser-Ney language model with its continuation counts indexed once
latent_fidelity.py  Fréchet distance, k-NN precision and recall, std ratio of generated latents (`fidelity`)

Each module is imported by its own name (`from mmldlm.evaluation.evaluate import evaluate`): this package
re-exports nothing, so importing one module does not load the others (kneser_ney loads nltk).
Evaluation during training (mmldlm/training/evaluation.py) stays with the trainer it reads and the ranks
it synchronises (training/distributed.py): evaluation imports nothing of training.
"""
