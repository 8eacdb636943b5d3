"""Drop-in compatibility with the checkpoint managers of TensorFlow and orbax."""
