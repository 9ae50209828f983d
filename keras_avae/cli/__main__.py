"""`python -m keras_avae.cli`: the same as the `keras-avae` console script."""

from keras_avae.cli import main_exit

if __name__ == "__main__":
    main_exit()
