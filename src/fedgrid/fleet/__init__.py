"""What every fleet is and speaks, below both of them: the ``Fleet`` contract the round engine
drives (``fleet/base.py``) and the per-client round protocol that ``RemoteFleet``
(``fedgrid.server``) and ``InProcessFleet`` (``fedgrid.simulation``) share, so the two differ
only in transport:

- ``fleet/protocol.py``: the fit task's configuration, the download's names, the update's form,
  acceptance and the byte tally;
- ``fleet/bounds.py``: what a client may report and an update may claim and change;
- ``fleet/codec_policy.py``: the uplink codec (and its error feedback) of each client;
- ``fleet/downlink.py``: what each client downloads, and the shadow of a lossy downlink.
"""
