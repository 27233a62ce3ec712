"""Dense DWDP: the MoE decoder layers' attention and MoE-dense weights, row-sharded.

``architecture`` declares what moves (dense roots and name tables), ``layout`` collects
blobs A(l)/D(l) from a model and cuts them into rows, ``rows`` places the rows in a row
store and builds the copy plans that gather a blob into a prefetch slot.
"""
