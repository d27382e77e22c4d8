"""The app's runtime on CPU: the decode stepper that carries caches between
the chunks of a layout (`stepper`) and `chunkforge run`, text from a release
folder alone (`release`)."""
