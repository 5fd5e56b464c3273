# The entry point of the older trainer as its launchers call it: only its Hydra decorator matters to
# `mmldlm migrate`, which reads config_path from it (tests/test_migrate.py). Never run.
import hydra


@hydra.main(config_path="configs", config_name="stable_l2t", version_base=None)
def main(cfg):
    raise SystemExit("a stand-in for the older trainer")


if __name__ == "__main__":
    main()
