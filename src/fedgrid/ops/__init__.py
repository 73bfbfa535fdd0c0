"""Operator tools: what an operator runs beside a federation, reached only from the command line.

``launch`` (a topology as local processes), ``wan`` (an emulated WAN link), ``lab`` (real hosts
and links in network namespaces, as root: the tests' and benchmarks' lab), ``health`` (is it
serving), ``watch`` (a coordinator's status), ``report`` (plots of run directories), ``new_app``
(an app template) and ``pki`` (administering the certificate authority). Nothing in the
coordinator, the client or the simulation imports them.
"""
