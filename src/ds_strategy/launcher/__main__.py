"""``python -m ds_strategy.launcher`` is ``ds-launch``."""

from ds_strategy.launcher.launch import main

if __name__ == "__main__":
    main()
