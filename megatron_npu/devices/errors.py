"""Errors of the device layer."""


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot be used here; the message says why and what to do."""


class UnknownDeviceError(ValueError):
    """A device name that is none of the adaptor's devices; the message lists them."""
