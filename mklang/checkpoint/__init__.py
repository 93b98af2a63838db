"""Runs that outlive a process (SPEC section 7): what is stored and how it is checked.

The envelope and its schema (`envelope`), the crash journal and its recovery
(`journal`), seals and signatures (`signing`), generations against rollback
(`generations`), machine paths and the machine texts a store keeps (`paths`,
`texts`), frames recorded by older versions (`compat`) and what a reopened
run may decide about its host (`trust`). The bytes live in a store
(`mklang.stores`); opening and driving a stored run is `mklang.runs`.
"""
